#!/bin/sh
# One private CA and a certificate for each service, and the Redis password, for
# docker-compose.yml and the Kubernetes Secrets (deploy/README.md, Security).
#
#   scripts/make_certs.sh [DIR]    # DIR: deploy/secrets (git ignores it)
#
# DIR/ca.key              the CA's key: keep it off the servers, it signs new certificates
# DIR/SERVICE/            executor, scheduler, redis: tls.crt, tls.key, ca.crt
# DIR/redis/users.acl     Redis ACL: user `pagedserve` (password as its SHA-256), and a
#                         default user that may only PING (the health checks)
# DIR/redis.env           PAGEDSERVE_STATE_STORE=rediss://pagedserve:PASSWORD@redis:6379/0?...
#
# Each certificate is good for servers and clients (the scheduler presents its own to
# executors, an executor's health check its own) and names the service, its Kubernetes DNS
# names in NAMESPACE (default pagedserve), localhost and 127.0.0.1. Run it again to rotate:
# it keeps an existing CA and password unless they are deleted first.
set -eu
dir=${1:-deploy/secrets}
namespace=${NAMESPACE:-pagedserve}
days=${DAYS:-365}
umask 077
mkdir -p "$dir"
if [ ! -f "$dir/ca.key" ]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 3650 \
    -subj "/CN=pagedserve CA" -keyout "$dir/ca.key" -out "$dir/ca.crt" 2>/dev/null
fi
for service in executor scheduler redis; do
  mkdir -p "$dir/$service"
  out=$dir/$service
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$service" \
    -keyout "$out/tls.key" -out "$out/tls.csr" 2>/dev/null
  names=DNS:$service,DNS:$service.$namespace,DNS:$service.$namespace.svc
  printf '%s\n' "subjectAltName=$names,DNS:localhost,IP:127.0.0.1" \
    "extendedKeyUsage=serverAuth,clientAuth" "basicConstraints=critical,CA:FALSE" >"$out/ext.cnf"
  openssl x509 -req -in "$out/tls.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" \
    -CAcreateserial -days "$days" -extfile "$out/ext.cnf" -out "$out/tls.crt" 2>/dev/null
  rm "$out/tls.csr" "$out/ext.cnf"
  cp "$dir/ca.crt" "$out/ca.crt"
  # Mounted into containers that run as other users (10001, Redis' 999); $dir stays 0700.
  chmod 755 "$out" && chmod 644 "$out"/*
done
if [ ! -f "$dir/redis.env" ]; then
  password=$(openssl rand -hex 32)
  digest=$(printf %s "$password" | openssl dgst -sha256 -r | cut -d' ' -f1)
  printf '%s\n' "user default on nopass -@all +ping" \
    "user pagedserve on #$digest ~* &* +@all" >"$dir/redis/users.acl"
  chmod 644 "$dir/redis/users.acl"
  ca=/etc/pagedserve/tls/ca.crt  # where both deployments mount it
  printf 'PAGEDSERVE_STATE_STORE=rediss://pagedserve:%s@redis:6379/0?ssl_ca_certs=%s\n' \
    "$password" "$ca" >"$dir/redis.env"
fi
echo "wrote $dir"
