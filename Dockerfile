# dedupe-proxy container image.
#
#   docker build -t dedupe-proxy:0.1.0 .
#   docker run --rm --stop-timeout 30 -p 8080:8080 -p 127.0.0.1:9090:9090 --read-only \
#     -v "$PWD/config.yaml:/etc/dedupe-proxy/config.yaml:ro" -v dedupe-data:/data dedupe-proxy:0.1.0
#
# The runtime image is distroless (glibc and CA certificates, no shell): the
# binary runs as the unprivileged user 65532 and writes only to /data, where a
# relative `sqlite://dedupe.db` store lands. Mount a volume there for the
# embedded SQLite store; with PostgreSQL (DEDUPE_STORE_URL) nothing is written
# and the root filesystem can be read-only.
#
# Health: there is no HEALTHCHECK, because the image has no shell or HTTP
# client to run one. Probe the admin port from outside the container instead:
# GET /healthz (the process serves) for liveness and, for readiness, GET /readyz
# (the store answers; 503 otherwise) or /healthz, as the Helm chart chooses per
# shape and the manifests in deploy/kubernetes do (README: Deploy). The admin listener must bind 0.0.0.0 for that
# (`admin_listen: 0.0.0.0:9090` in the mounted configuration).

# The toolchain the project is tested with; its patch releases follow. Pin
# digests (name@sha256:…) where builds must be reproducible.
ARG RUST_IMAGE=rust:1.95-bookworm
ARG RUNTIME_IMAGE=gcr.io/distroless/cc-debian12:nonroot

FROM ${RUST_IMAGE} AS builder
WORKDIR /build

# Dependencies first, against stub sources, so that a change to src/ does not
# rebuild them: this layer is reused while Cargo.toml and Cargo.lock stay put.
COPY Cargo.toml Cargo.lock ./
RUN mkdir src \
    && echo 'fn main() {}' > src/main.rs \
    && touch src/lib.rs \
    && cargo build --release --locked \
    && rm -rf src

COPY src ./src
# The stub build left newer artifacts than the copied sources' timestamps.
RUN touch src/main.rs src/lib.rs \
    && cargo build --release --locked \
    && install -D -m 0755 target/release/dedupe-proxy /out/usr/local/bin/dedupe-proxy \
    && install -d -m 0750 /out/root/data

FROM ${RUNTIME_IMAGE}
ARG RUNTIME_IMAGE
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="dedupe-proxy" \
      org.opencontainers.image.description="A reverse proxy that makes an unmodified application's webhook endpoints idempotent" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.base.name="${RUNTIME_IMAGE}"

COPY --from=builder /out/usr/local/bin/dedupe-proxy /usr/local/bin/dedupe-proxy
# Owned by the runtime user, so a fresh named volume mounted here is writable.
COPY --from=builder --chown=65532:65532 /out/root/ /

WORKDIR /data
ENV DEDUPE_CONFIG=/etc/dedupe-proxy/config.yaml
USER 65532:65532
# 8080: webhooks (listen). 9090: /metrics, /healthz, /readyz (admin_listen).
EXPOSE 8080 9090
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/dedupe-proxy"]
CMD ["run"]
