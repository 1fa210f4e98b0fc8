//! Configuration: the validated model (§12a) and its TOML / environment parsing (§12).

mod model;
pub mod parse;

pub use model::*;
