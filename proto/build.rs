//! Compiles `proto/prefixrouter/v1/*.proto` with a vendored protoc, so no manual install is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    std::env::set_var("PROTOC", protoc);
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("prefixrouter_descriptor.bin"))
        .bytes(".prefixrouter.v1.WatchRoutingTableResponse.routing_table")
        .compile_protos(&["proto/prefixrouter/v1/prefixrouter.proto"], &["proto"])?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
