# Multi-stage build of every prefix-router binary.
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bins

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/control-plane /src/target/release/data-plane \
     /src/target/release/engine-sim /src/target/release/prefixctl /usr/local/bin/
EXPOSE 7070 7071 8080 9000
ENTRYPOINT ["prefixctl"]
