#!/usr/bin/env bash
# Execute every cell of the example notebooks (examples/0*.ipynb), the `gpu`-tagged ones included,
# on the GPU machine, and save the executed notebooks into $OUT: those are the notebooks to commit
# (their outputs come from this run).
#
# On the dev machine, first:
#   1. stage the wheels the GPU image lacks (nbclient/ipykernel and their dependencies; pydantic for
#      the bench report), with the default ones:
#        ../shared/device/prepare.sh nbclient==0.11.0 nbformat==5.11.1 ipykernel==7.4.0 ipython==9.18.1 \
#          ipython_pygments_lexers==1.1.1 jupyter_client==8.10.0 jupyter_core==5.9.1 traitlets==5.16.1 \
#          pyzmq==27.3.0 tornado==6.6.1 comm==0.2.3 matplotlib_inline==0.2.2 nest_asyncio2==1.7.4 psutil==7.2.2 \
#          platformdirs==4.14.9 fastjsonschema==2.22.3 jsonschema==4.26.0 jsonschema_specifications==2025.9.1 \
#          referencing==0.37.0 rpds_py==2026.9.1 attrs==26.1.0 pygments==2.21.0 prompt_toolkit==3.0.53 \
#          wcwidth==0.9.4 pexpect==4.9.0 ptyprocess==0.7.0 stack_data==0.6.3 executing==2.3.0 asttokens==3.0.2 \
#          pure_eval==0.2.4 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
#      (about 8.5 MB on top of the default 15 MB);
#   2. cutile-kernels build --arch sm_90
#   3. bash benchmarks/device_notebooks.sh prepare     (in the project's venv)
#      The GPU image has no cuTile compiler, so notebook 03's kernel is compiled here: this runs that
#      notebook on the CPU with its scratch directory kept in .device/tutorial (carried with .device).
# Then one device run:
#   run(command="source scripts/device-setup.sh && bash benchmarks/device_notebooks.sh", carry=[".device", "build"])
# It takes about 5 minutes (notebook 02 benches the llama-3.2-1b preset).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
notebooks=("$root"/examples/0*.ipynb)
tutorial="$root/.device/tutorial"

if [ "${1:-}" = "prepare" ]; then
    rm -rf "$tutorial" && mkdir -p "$tutorial"
    CUTILE_TUTORIAL_DIR="$tutorial" "${PYTHON:-python}" -m cutile_kernels_tools.notebooks "$root/examples/03_new_kernel.ipynb"
    test -f "$tutorial/build/quick_gelu.py.sha256"
    du -sh "$tutorial" | awk '{print "tutorial build staged: " $1 " in .device/tutorial"}'
    exit 0
fi

: "${OUT:?set by the device tool: run this on the GPU machine (see the header)}"
missing=$(python3 - <<'PY'
import importlib.util
mods = ["nbclient", "nbformat", "ipykernel", "IPython", "jupyter_client", "zmq", "tornado", "jsonschema", "pydantic"]
print(" ".join(m for m in mods if importlib.util.find_spec(m) is None))
PY
)
if [ -n "$missing" ]; then
    echo "device_notebooks: missing on this machine: $missing" >&2
    echo "stage the wheels listed in the header of benchmarks/device_notebooks.sh with ../shared/device/prepare.sh" >&2
    exit 3
fi
if [ ! -f "$tutorial/build/quick_gelu.py.sha256" ]; then
    echo "device_notebooks: no tutorial cubins in .device/tutorial: run 'bash benchmarks/device_notebooks.sh prepare'" \
         "on the dev machine first (this machine has no cuTile compiler)" >&2
    exit 3
fi
export CUTILE_TUTORIAL_DIR=/tmp/cutile-tutorial
rm -rf "$CUTILE_TUTORIAL_DIR" && cp -r "$tutorial" "$CUTILE_TUTORIAL_DIR"
export JUPYTER_RUNTIME_DIR=/tmp/jupyter-runtime IPYTHONDIR=/tmp/ipython MPLBACKEND=Agg
export CUTILE_KERNELS_PRESET_DIR=${CUTILE_KERNELS_PRESET_DIR:-/tmp/presets}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/notebooks.log"
# From outside the checkout, so that `import cutile_kernels` is the installed package.
cd /tmp
set +e
python3 -m cutile_kernels_tools.notebooks --all-cells --timeout 900 --out "$OUT" "${notebooks[@]}" 2>&1 \
    | grep -v "Kernel is running over TCP" | tee -a "$OUT/notebooks.log"
status=${PIPESTATUS[0]}
echo "device_notebooks: exit $status (executed notebooks in \$OUT)"
exit "$status"
