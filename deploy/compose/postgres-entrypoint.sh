#!/bin/sh
# The official postgres image's first start, for the Debian package: an empty data directory gets a cluster
# whose superuser is POSTGRES_USER (password POSTGRES_PASSWORD, scram) and the database POSTGRES_DB.
set -eu
bin=/usr/lib/postgresql/15/bin
data=/var/lib/postgresql/data
: "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD}"
user=${POSTGRES_USER:-postgres}
db=${POSTGRES_DB:-$user}
if [ ! -s "$data/PG_VERSION" ]; then
  pwfile=$(mktemp)
  printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
  "$bin/initdb" -D "$data" -U "$user" --pwfile="$pwfile" -A scram-sha-256 >/dev/null
  rm -f "$pwfile"
  if [ "$db" != postgres ]; then
    echo "CREATE DATABASE \"$db\"" | "$bin/postgres" --single -D "$data" postgres >/dev/null
  fi
fi
exec "$bin/postgres" -D "$data" -c listen_addresses=127.0.0.1 -p "$PGPORT" -k /run/postgresql
