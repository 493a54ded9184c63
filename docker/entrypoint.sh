#!/bin/sh
# Container entrypoint: `docker run IMAGE ARGS...` runs `specserve ARGS...`.
# With no arguments it runs the server on all interfaces, port 8000.
set -eu

if [ "$#" -eq 0 ]; then
    set -- serve --host 0.0.0.0 --port 8000
fi

# A shell or Python for debugging: docker run -it IMAGE bash
case "$1" in
    sh | bash | python | python3) exec "$@" ;;
esac

exec specserve "$@"
