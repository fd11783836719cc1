# converge/prometheus:<version>: Debian bookworm's Prometheus server (package `prometheus`,
# a Go binary linked against glibc only) on the local converge/base:bookworm, for the
# compose cluster's optional `monitoring` profile. Build context (made by
# deploy/build-prometheus-image.sh):
#   prometheus, promtool   from the .deb's /usr/bin
#   prometheus.yml         deploy/prometheus/prometheus.yml (compose mounts it over this copy)
FROM converge/base:bookworm
COPY prometheus promtool /usr/local/bin/
COPY prometheus.yml /etc/prometheus/prometheus.yml
RUN mkdir -p /prometheus && chown 10001:10001 /prometheus
USER 10001:10001
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/tini", "--", "/usr/local/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus", \
     "--storage.tsdb.retention.time=7d", "--web.listen-address=:9090"]
