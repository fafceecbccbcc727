# Source on the GPU machine from the project root (after ../shared/device/prepare.sh and a build
# were carried): installs the carried wheels and this project into /tmp/site, points the runtime
# at the carried build, and prints the environment. The bench's report needs pydantic, which the
# GPU image lacks: stage it with the rest,
#   ../shared/device/prepare.sh pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
#   cutile-kernels build --arch sm_90
# and on the GPU machine:
#   source scripts/device-setup.sh
source .device/setup.sh || return 1
# The build travels compressed (the tree's carry limit is 64 MiB; xz halves gzip's 30 MB of sm_90 cubins):
#   tar cJf .device/build.txz build    (or czf .device/build.tgz; after `cutile-kernels build --arch sm_90`)
# Always unpacked afresh: a machine still warm from the previous call keeps its old build/.
if [ -f .device/build.txz ]; then rm -rf build && tar xJf .device/build.txz || return 1;
elif [ -f .device/build.tgz ]; then rm -rf build && tar xzf .device/build.tgz || return 1; fi
# --upgrade: on a machine still warm from the previous call, --target keeps the old copy otherwise.
python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-compile --target /tmp/site . >/tmp/pip-project.log 2>&1 \
  || { cat /tmp/pip-project.log; return 1; }
export CUTILE_KERNELS_BUILD_DIR="$PWD/build"
# flash-linear-attention for the bench's stock+fla path only, in a folder of its own (the other
# paths hide it anyway): stage its wheels into .device/fla/ (flash-linear-attention, fla-core, einops).
if ls .device/fla/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --upgrade --no-deps --no-compile --target /tmp/site-fla .device/fla/*.whl >/tmp/pip-fla.log 2>&1 \
    && export CUTILE_BENCH_FLA_PATH=/tmp/site-fla || cat /tmp/pip-fla.log
fi
export PATH="/tmp/site/bin:$PATH"
# Bytecode as a user's pip install leaves it: the wheels above go in with --no-compile, and the
# image sets PYTHONDONTWRITEBYTECODE, so without this every fresh process compiled the module
# sources of transformers, our package and its build (about 200 more for our paths) inside the
# bench's load figure. Written next to the sources (both folders are ours); the image's own
# packages keep whatever bytecode they ship, for every path alike.
# (Source this file in the shell itself: `source ... | grep` runs it in a subshell, setting nothing.)
_cutile_t0=$SECONDS
python3 -m compileall -q -j 0 /tmp/site build > /tmp/compileall.log 2>&1 \
  || { echo "compileall failed (bytecode left out):"; tail -5 /tmp/compileall.log; }
echo "bytecode of /tmp/site and build: $((SECONDS - _cutile_t0)) s"; unset _cutile_t0
# Run from outside the checkout so that `import cutile_kernels` is the installed package.
python3 -c "import cutile_kernels, sys; print('cutile_kernels from', cutile_kernels.__file__, 'build', cutile_kernels.registry.find_package_dir())"
