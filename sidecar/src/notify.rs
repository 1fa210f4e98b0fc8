//! sd_notify (being written).
