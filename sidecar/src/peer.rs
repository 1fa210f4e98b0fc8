//! Peer credential policy (being written).
