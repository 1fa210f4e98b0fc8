# syntax=docker/dockerfile:1
# The PolyGate sidecar as a container image: built in a Rust image from this
# repository, run from debian:bookworm-slim (the binary's glibc, and a shell for
# the Kubernetes manifests' one-line socket-directory step) as a non-root user.
#
#   docker build -t polygate-sidecar .
#   docker run -v polygate-run:/run/polygate polygate-sidecar
#
# Workers in other containers share /run/polygate (a volume) and connect to
# /run/polygate/sidecar.sock (set POLYGATE_SOCKET to it: a non-root worker's default
# is under its own $XDG_RUNTIME_DIR). They need group 65532 (socket_mode 0660,
# directory 0750). deploy/kubernetes/ has a DaemonSet and a per-pod variant.

# The toolchain the locked dependencies need (Cargo.toml rust-version).
ARG RUST_VERSION=1.88

FROM rust:${RUST_VERSION}-slim-bookworm AS build
WORKDIR /src
# The workspace: every member must be present for cargo to resolve it.
COPY Cargo.toml Cargo.lock ./
COPY ipc-protocol ipc-protocol
COPY sidecar sidecar
COPY bench bench
COPY examples examples
RUN cargo build --release --locked -p polygate-sidecar \
 && install -D -m 0755 target/release/polygate-sidecar /out/usr/bin/polygate-sidecar \
 && install -d -m 0750 /out/run/polygate

FROM debian:bookworm-slim
COPY --from=build /out/usr/bin/polygate-sidecar /usr/bin/polygate-sidecar
# The socket directory: owned by the runtime user, not writable by others (the
# daemon refuses a directory another user could write).
COPY --from=build --chown=65532:65532 /out/run/polygate /run/polygate
COPY examples/polygate.toml /etc/polygate/polygate.toml
# The socket path is explicit: the non-root default would be under $XDG_RUNTIME_DIR,
# which a container does not set. The admin listener serves /live, /ready, /metrics.
ENV SIDECAR__SOCKET=/run/polygate/sidecar.sock \
    SIDECAR__ADMIN_LISTEN=0.0.0.0:9464 \
    RUST_LOG=info
USER 65532:65532
VOLUME ["/run/polygate"]
EXPOSE 9464
HEALTHCHECK --interval=10s --timeout=6s --start-period=5s --retries=3 \
    CMD ["polygate-sidecar", "health", "--admin", "127.0.0.1:9464"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["polygate-sidecar"]
CMD ["--config", "/etc/polygate/polygate.toml"]
