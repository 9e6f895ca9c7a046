# Sourced by the CLI tests that train a tiny demo model in the background: a temporary directory
# $TMP (removed at exit, with any process still running on its config), one OpenBLAS thread, and
# $TMP/config.json, the demo-tiny model at hidden 64 with 2 layers.
TMP=$(mktemp -d)
cleanup() { pkill -KILL -f -- "$TMP/config.json" 2> /dev/null; rm -rf "$TMP"; }
trap cleanup EXIT
export OPENBLAS_NUM_THREADS=1
sed -e 's/"hidden_size": 128/"hidden_size": 64/' -e 's/"num_hidden_layers": 4/"num_hidden_layers": 2/' \
  configs/models/demo-tiny/config.json > "$TMP/config.json"
