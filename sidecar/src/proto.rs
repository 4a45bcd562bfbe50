//! Code generated from ../proto by build.rs.

tonic::include_proto!("cyllm.inference.v1");

pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("cyllm_descriptor");
pub const INFERENCE_SERVICE: &str = "cyllm.inference.v1.InferenceService";
