//! TOML + environment parsing and validation. (Being written.)
