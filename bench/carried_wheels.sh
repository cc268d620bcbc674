# Sourced by the bench scripts that run on a lent GPU machine, which lacks
# ml-collections and tensorboardX: installs the wheels carried in wheels/
# (WHEELS=DIR for another folder, WHEELS= for none; a path from the
# repository root) into /tmp/site and puts it first on PYTHONPATH, once
# per process tree. Without wheels it does nothing.
wheels=${WHEELS-wheels}
if [[ -n "$wheels" && ":${PYTHONPATH:-}:" != *":/tmp/site:"* ]] \
    && compgen -G "$wheels/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
