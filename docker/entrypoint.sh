#!/bin/sh
# Container entrypoint: `docker run IMAGE ARGS...` runs `specserve ARGS...`.
# With no arguments it runs the default below. Until the HTTP server exists (next issue) that is the
# offline generator; it becomes `serve --host 0.0.0.0 --port 8000` when the server lands.
set -eu

if [ "$#" -eq 0 ]; then
    set -- generate --chat "Hello! Who are you?"
fi

# A shell or Python for debugging: docker run -it IMAGE bash
case "$1" in
    sh | bash | python | python3) exec "$@" ;;
esac

exec specserve "$@"
