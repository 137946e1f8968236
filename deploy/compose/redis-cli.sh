#!/bin/sh
# redis-cli against this container's redis-server (REDIS_PORT).
exec /usr/bin/redis-cli -p "$REDIS_PORT" "$@"
