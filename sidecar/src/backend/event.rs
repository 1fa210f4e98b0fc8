//! Operator actions that a shared backend broadcasts to every host (§9, §12): when
//! an operator force-closes or resets a source on one host, every other host must
//! forget its cooldown memo for it. A backend produces [`AdminEvent`]s (Redis:
//! pub/sub messages `"<op> <source>"` published by the admin script); the engine
//! applies them (`Engine::apply_admin_event`).

/// An operator action broadcast to every host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdminEvent {
    /// The source acted on.
    pub source: String,
    /// What was done.
    pub op: AdminOp,
}

/// Admin operations that are broadcast.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdminOp {
    /// `force_open`.
    ForceOpen,
    /// `force_close`.
    ForceClose,
    /// `reset`.
    Reset,
}

impl AdminOp {
    /// The operation's one spelling (script operation name and broadcast payload).
    pub(crate) const fn wire(self) -> &'static str {
        match self {
            AdminOp::ForceOpen => "force_open",
            AdminOp::ForceClose => "force_close",
            AdminOp::Reset => "reset",
        }
    }

    /// The operation spelled `s`, if any.
    pub(crate) fn from_wire(s: &str) -> Option<Self> {
        match s {
            "force_open" => Some(AdminOp::ForceOpen),
            "force_close" => Some(AdminOp::ForceClose),
            "reset" => Some(AdminOp::Reset),
            _ => None,
        }
    }
}

impl AdminEvent {
    /// Parse a `"<op> <source>"` payload.
    pub(crate) fn parse(payload: &str) -> Option<Self> {
        let (op, source) = payload.split_once(' ')?;
        Some(AdminEvent {
            source: source.to_string(),
            op: AdminOp::from_wire(op)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admin_payload_round_trip() {
        for op in [AdminOp::ForceOpen, AdminOp::ForceClose, AdminOp::Reset] {
            let ev = AdminEvent::parse(&format!("{} my source", op.wire())).unwrap();
            assert_eq!(
                ev,
                AdminEvent {
                    source: "my source".into(),
                    op
                }
            );
        }
        assert!(AdminEvent::parse("bogus x").is_none());
        assert!(AdminEvent::parse("reset").is_none());
    }
}
