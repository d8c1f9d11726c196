#!/usr/bin/env bash
# Entrypoint of docker/Dockerfile, run by /opt/nvidia/nvidia_entrypoint.sh (which sets up the CUDA
# compatibility libraries), then runs its arguments (the image's CMD: tritonserver + flags) and passes
# TERM and INT on to them after marking the shutdown (below).
#
# Docker does not expand variables in an exec-form CMD, so the production flags carry the literal text
# ${INFLIGHT_ADMIN_KEY}; it is replaced here with the variable's value. A server started with an empty
# admin key would leave the restricted APIs behind an empty header value, so an unset key is an error.
set -euo pipefail

placeholder='${INFLIGHT_ADMIN_KEY}'
args=()
for arg in "$@"; do
  if [[ "$arg" == *"$placeholder"* ]]; then
    if [[ -z "${INFLIGHT_ADMIN_KEY:-}" ]]; then
      echo "inflight: INFLIGHT_ADMIN_KEY is not set; it is the 'admin-key' header value that Triton's" \
           "restricted APIs require (see the --*-restricted-* flags). Pass e.g." \
           "-e INFLIGHT_ADMIN_KEY=\"\$(openssl rand -hex 32)\"" >&2
      exit 64
    fi
    # quoted pattern and replacement: matched literally, and '&' in the key stays '&' (bash 5.2)
    arg="${arg//"$placeholder"/"$INFLIGHT_ADMIN_KEY"}"
  fi
  args+=("$arg")
done
if [[ ${#args[@]} -eq 0 ]]; then
  exec /bin/bash
fi

# Graceful stop, as `make serve --production` and the CPU image's launcher stop: on TERM or INT the
# shutdown flag the engine watches (INFLIGHT_SHUTDOWN_FLAG) is written before the signal reaches
# tritonserver, so every request in flight ends at once with a final "the server is shutting down"
# response; without it a generation longer than --exit-timeout-secs was cut with no response at all.
flag="$(mktemp -u /tmp/inflight-shutdown-XXXXXXXX)"
export INFLIGHT_SHUTDOWN_FLAG="$flag"
"${args[@]}" &
child=$!
signals=0
stop() {
  signals=$((signals + 1))
  echo "$1" > "$flag"
  kill -s "$1" "$child" 2>/dev/null || true
}
trap 'stop TERM' TERM
trap 'stop INT' INT
while :; do
  before=$signals
  status=0
  wait "$child" || status=$?
  [[ $signals == "$before" ]] && break      # not a trap interrupting the wait: the server's own exit
done
rm -f "$flag"
exit "$status"
