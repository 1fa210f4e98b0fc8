//! Reading `gate.lua`'s replies: typed values at a position of the reply array
//! (integers, durations in µs, flags, breaker states, bucket levels) and the
//! [`Applied`] reply every outcome and admin operation shares. A reply of another
//! shape is [`BackendError::Protocol`], naming what was expected.
//!
//! Its own module because every operation (`ops.rs`) reads its reply with these,
//! whatever arguments it sent (`script/argv.rs`).

use std::time::Duration;

use ::redis::Value;

use crate::backend::{Applied, BResult, BackendError, State, Trip};

pub(in crate::backend::redis) fn proto(what: &str, v: &[Value]) -> BackendError {
    BackendError::Protocol(format!("unexpected script reply ({what}): {v:?}"))
}

pub(in crate::backend::redis) fn int_at(v: &[Value], i: usize) -> BResult<i64> {
    match v.get(i) {
        Some(Value::Int(n)) => Ok(*n),
        Some(Value::BulkString(b)) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse::<f64>().ok())
            .map(|f| f as i64)
            .ok_or_else(|| proto("integer", v)),
        _ => Err(proto("integer", v)),
    }
}

pub(in crate::backend::redis) fn u64_at(v: &[Value], i: usize) -> BResult<u64> {
    Ok(int_at(v, i)?.max(0) as u64)
}

pub(in crate::backend::redis) fn dur_at(v: &[Value], i: usize) -> BResult<Duration> {
    Ok(Duration::from_micros(u64_at(v, i)?))
}

pub(in crate::backend::redis) fn bool_at(v: &[Value], i: usize) -> BResult<bool> {
    Ok(int_at(v, i)? != 0)
}

pub(in crate::backend::redis) fn state_at(v: &[Value], i: usize) -> BResult<State> {
    match int_at(v, i)? {
        0 => Ok(State::Closed),
        1 => Ok(State::Open),
        2 => Ok(State::HalfOpen),
        _ => Err(proto("state", v)),
    }
}

/// A level the script may not send (an older reply shape has fewer): `None`.
pub(in crate::backend::redis) fn level_or_none(v: &[Value], i: usize) -> BResult<Option<f64>> {
    if v.len() <= i {
        return Ok(None);
    }
    level_at(v, i)
}

pub(in crate::backend::redis) fn level_at(v: &[Value], i: usize) -> BResult<Option<f64>> {
    match v.get(i) {
        Some(Value::BulkString(b)) if b.is_empty() => Ok(None),
        Some(Value::BulkString(b)) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse::<f64>().ok())
            .map(Some)
            .ok_or_else(|| proto("level", v)),
        Some(Value::Int(n)) => Ok(Some(*n as f64)),
        _ => Err(proto("level", v)),
    }
}

/// The reply of every outcome and admin operation: `{applied, state, epoch,
/// retry_after_us, level, trip}` (trip: 0 none, 1 streak, 2 failure rate).
pub(in crate::backend::redis) fn applied(v: &[Value]) -> BResult<Applied> {
    Ok(Applied {
        applied: bool_at(v, 0)?,
        state: state_at(v, 1)?,
        epoch: u64_at(v, 2)?,
        retry_after: dur_at(v, 3)?,
        level: u64_at(v, 4)?.min(u32::MAX as u64) as u32,
        trip: match int_at(v, 5)? {
            0 => None,
            1 => Some(Trip::Streak),
            2 => Some(Trip::FailureRate),
            _ => return Err(proto("trip", v)),
        },
    })
}
