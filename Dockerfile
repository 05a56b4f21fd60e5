# idem's image: a non-root `idem serve` with a health check, drained by SIGTERM, no secrets inside
# (DATABASE_URL, IDEM_API_KEYS, … come from the environment or `*_FILE` mounts at run time).
#
#   where a registry is reachable:  docker build -t idem .
#       (build stage on the official Rust image, runtime on debian:bookworm-slim)
#   here (no registry; scripts/docker.sh builds idem-base from Debian's packages):
#       cargo build --release -p idem-app && docker build --target local -t idem:local .
#       (the binary built on the host, IDEM_BINARY=target/debug/idem for a debug one)
#
# The `local` stage comes first so that a builder without BuildKit stops there without pulling the others.

FROM idem-base:bookworm AS local
ARG IDEM_BINARY=target/release/idem
COPY ${IDEM_BINARY} /usr/local/bin/idem
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin idem
USER 10001
# public API on every interface of the container; the admin listener (readyz, metrics) by ADMIN_ADDR,
# loopback unless set (0.0.0.0:9090 to reach it inside a container network)
ENV HTTP_ADDR=0.0.0.0:8080 ADMIN_ADDR=127.0.0.1:9090
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
  CMD ["/bin/bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/${HTTP_ADDR##*:} && printf 'GET /healthz HTTP/1.0\\r\\n\\r\\n' >&3 && head -1 <&3 | grep -q ' 200 '"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/idem"]
CMD ["serve"]

FROM rust:1-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends cmake libcurl4-openssl-dev libssl-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p idem-app && cp target/release/idem /idem

FROM debian:bookworm-slim AS runtime
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates libcurl4 libssl3 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin idem
COPY --from=build /idem /usr/local/bin/idem
USER 10001
ENV HTTP_ADDR=0.0.0.0:8080 ADMIN_ADDR=127.0.0.1:9090
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
  CMD ["/bin/bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/${HTTP_ADDR##*:} && printf 'GET /healthz HTTP/1.0\\r\\n\\r\\n' >&3 && head -1 <&3 | grep -q ' 200 '"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/idem"]
CMD ["serve"]
