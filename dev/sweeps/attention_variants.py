"""Attention kernels with other compiler hints, for the prefill tile sweep (not shipped; see
attention_sweep.py). Same device code as ``kernel_src.attention.attention_kernel``."""

from cutile_kernels.kernel_src.attention import attention_kernel

#: Two warpgroups and two blocks per multiprocessor (the shipped prefill kernel asks for one).
attention_w8_occ2_kernel = attention_kernel.replace_hints(num_worker_warps=8, occupancy=2)
#: Blocks launched in clusters of two (TileGym's Hopper attention tiles use num_ctas up to 2).
attention_w8_cta2_kernel = attention_kernel.replace_hints(num_worker_warps=8, num_ctas=2)
#: Eight warps, the compiler's occupancy (the decode tile sweep, decode_attention_sweep.py).
attention_w8_kernel = attention_kernel.replace_hints(num_worker_warps=8)
