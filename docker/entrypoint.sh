#!/usr/bin/env bash
# Entrypoint of docker/Dockerfile, run by /opt/nvidia/nvidia_entrypoint.sh (which sets up the CUDA
# compatibility libraries), then exec's its arguments (the image's CMD: tritonserver + flags).
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
exec "${args[@]}"
