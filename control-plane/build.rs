//! Compiles etcd's v3 API (client side only; the .proto files of the etcd-client crate, which
//! are etcd's own with the gogoproto and HTTP-gateway options stripped) with a vendored protoc,
//! for the etcd store. No protoc install is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    std::env::set_var("PROTOC", protoc);
    tonic_prost_build::configure()
        .build_server(false)
        .compile_protos(&["proto/etcd/rpc.proto"], &["proto/etcd"])?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
