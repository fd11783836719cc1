# converge/allocator: the stateless scheduler (everything it knows is in NATS).
# Build context (made by deploy/build-images.sh):
#   bin/converge-allocator, bin/converge   release binaries built on a bookworm host
ARG BASE_IMAGE=converge/base:bookworm
FROM ${BASE_IMAGE}
RUN groupadd --system --gid 10001 converge \
 && useradd --system --uid 10001 --gid converge --home-dir /var/lib/converge --no-create-home \
        --shell /usr/sbin/nologin converge \
 && install -d -o converge -g converge -m 0755 /var/lib/converge
COPY bin/converge-allocator bin/converge /usr/local/bin/
# Plain log lines (the binaries colour them even when stderr is no terminal).
ENV NO_COLOR=1
USER converge
WORKDIR /var/lib/converge
# Configuration comes from the environment (CONVERGE_NATS_URL, CONVERGE_SCHEDULING_INTERVAL, ...; see
# `converge-allocator --help`). tini is PID 1 so that SIGTERM from `docker stop` reaches
# the allocator, which then exits cleanly.
ENTRYPOINT ["/usr/bin/tini", "--", "/usr/local/bin/converge-allocator"]
