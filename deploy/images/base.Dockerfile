# converge/base:bookworm built FROM a pulled Debian image, for hosts that can reach a
# registry (`deploy/build-images.sh --base-from debian:bookworm-slim`). Offline, the
# script builds the same image with debootstrap + `docker import` instead and never uses
# this file. Either way the base holds Debian bookworm (the glibc the host-built release
# binaries link against) and what the binaries need at run time:
#   ca-certificates  TLS to NATS once security is configured
#   tini             PID 1: forwards SIGTERM to the service, reaps orphaned workers
#   procps, iproute2 ps/pkill/ip/ss for debugging and the compose tests
ARG DEBIAN_IMAGE=debian:bookworm-slim
FROM ${DEBIAN_IMAGE}
RUN apt-get update \
 && apt-get upgrade -y \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        ca-certificates tini procps iproute2 \
 && rm -rf /var/lib/apt/lists/*
CMD ["/bin/bash"]
