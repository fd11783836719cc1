# converge/agent: the node agent, the reference worker it launches (converge-trainer) and
# the datasets of the example jobs. Build context (made by deploy/build-images.sh):
#   bin/converge-agent, bin/converge-trainer, bin/converge   release binaries
#   data/{a9a,millionsong,optdigits,mnist_subset}            the repository's data/
ARG BASE_IMAGE=converge/base:bookworm
FROM ${BASE_IMAGE}
RUN groupadd --system --gid 10001 converge \
 && useradd --system --uid 10001 --gid converge --home-dir /var/lib/converge --no-create-home \
        --shell /usr/sbin/nologin converge \
 && install -d -o converge -g converge -m 0755 \
        /var/lib/converge /var/lib/converge/checkpoints /var/lib/converge/logs
# Datasets first: they change less often than the binaries.
COPY data/ /opt/converge/data/
COPY bin/converge-agent bin/converge-trainer bin/converge /usr/local/bin/
# Workers inherit the agent's environment: converge-trainer reads its datasets from
# CONVERGE_DATA_DIR. The checkpoint root must be the same shared volume on every agent
# (jobs move between hosts); worker logs are <log dir>/<job>/gen<g>-rank<r>.log.
# NO_COLOR: plain log lines (the binaries colour them even when stderr is no terminal).
# NVIDIA_*: what the NVIDIA container runtime injects on real GPU nodes (NVML comes from
# the driver, loaded at run time); ignored elsewhere.
ENV NO_COLOR=1 \
    CONVERGE_DATA_DIR=/opt/converge/data \
    CONVERGE_CHECKPOINT_ROOT=/var/lib/converge/checkpoints \
    CONVERGE_LOG_DIR=/var/lib/converge/logs \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER converge
WORKDIR /var/lib/converge
# tini is PID 1: it forwards `docker stop`'s SIGTERM to the agent, which stops its
# workers (SIGTERM to each worker's process group, --stop-grace, then SIGKILL) and exits;
# give the container a stop timeout longer than the grace (compose: stop_grace_period).
# tini also reaps any orphaned worker descendants.
ENTRYPOINT ["/usr/bin/tini", "--", "/usr/local/bin/converge-agent"]
