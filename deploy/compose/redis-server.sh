#!/bin/sh
# redis-server on 127.0.0.1:REDIS_PORT with its data in /data, whatever else the command line asks.
exec /usr/bin/redis-server "$@" --bind 127.0.0.1 --port "$REDIS_PORT" --dir /data
