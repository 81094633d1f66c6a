# Prometheus from Debian's package, for the podman test (the public image is not reachable
# here). Same entrypoint contract as the public image: the compose file's command is its
# arguments; wget for the compose healthcheck.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends prometheus wget \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /prometheus && chown nobody:nogroup /prometheus
USER nobody
ENTRYPOINT ["/usr/bin/prometheus"]
