# Stands in for Jaeger in the podman test (no Jaeger image is reachable here): rotel, a real
# OTLP collector from the `rotel` package, on Jaeger's OTLP ports, printing every span it
# receives to its log, which the test reads.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
# rotel-agent links against libpython.
RUN if ! ls /usr/lib/x86_64-linux-gnu/libpython3.11.so.1.0 >/dev/null 2>&1; then \
        apt-get update && apt-get install -y --no-install-recommends libpython3.11 \
        && rm -rf /var/lib/apt/lists/*; \
    fi
COPY rotel-agent /usr/local/bin/rotel-agent
ENTRYPOINT ["/usr/local/bin/rotel-agent", "start", \
    "--otlp-grpc-endpoint", "0.0.0.0:4317", "--otlp-http-endpoint", "0.0.0.0:4318", \
    "--exporter", "blackhole", "--debug-log", "traces", "--debug-log-verbosity", "detailed"]
