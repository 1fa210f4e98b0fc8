//! Peer credential policy (§12): who may connect to the socket, and who may send
//! admin requests.
//!
//! The first line of defence is the socket file's mode and group (default 0660): a
//! process that cannot open the file never gets here. [`AccessPolicy`] narrows that
//! further with the peer's kernel-reported credentials (`SO_PEERCRED`, read once at
//! accept through [`peer_of`]). Note that `SO_PEERCRED` carries the peer's *primary*
//! gid only; membership through supplementary groups is what the socket file's
//! group is for.

use std::io;

use crate::config::SidecarConfig;

/// A connected peer's credentials, as the kernel reported them at `connect(2)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    /// Effective user id.
    pub uid: u32,
    /// Effective (primary) group id.
    pub gid: u32,
    /// Process id, when the platform reports it.
    pub pid: Option<i32>,
}

/// Reads the credentials of the process at the other end of `stream`
/// (`SO_PEERCRED` on Linux).
pub fn peer_of(stream: &tokio::net::UnixStream) -> io::Result<Peer> {
    let cred = stream.peer_cred()?;
    Ok(Peer {
        uid: cred.uid(),
        gid: cred.gid(),
        pid: cred.pid(),
    })
}

/// Connection and admin rules from `[sidecar]`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AccessPolicy {
    /// If non-empty, these uids may connect.
    pub allowed_uids: Vec<u32>,
    /// If non-empty, peers with these primary gids may connect.
    pub allowed_gids: Vec<u32>,
    /// These uids may send admin requests (ForceOpen / ForceClose / Reset).
    pub admin_uids: Vec<u32>,
}

impl AccessPolicy {
    /// The policy configured in `[sidecar]`.
    pub fn from_config(c: &SidecarConfig) -> Self {
        AccessPolicy {
            allowed_uids: c.allowed_uids.clone(),
            allowed_gids: c.allowed_gids.clone(),
            admin_uids: c.admin_uids.clone(),
        }
    }

    /// Both lists empty: anyone who can open the socket. Otherwise the uid is in
    /// `allowed_uids` OR the gid is in `allowed_gids` (either list admits).
    pub fn may_connect(&self, uid: u32, gid: u32) -> bool {
        (self.allowed_uids.is_empty() && self.allowed_gids.is_empty())
            || self.allowed_uids.contains(&uid)
            || self.allowed_gids.contains(&gid)
    }

    /// Admin requests need the uid in `admin_uids` (an empty list: nobody).
    pub fn may_admin(&self, uid: u32) -> bool {
        self.admin_uids.contains(&uid)
    }
}

impl From<&SidecarConfig> for AccessPolicy {
    fn from(c: &SidecarConfig) -> Self {
        AccessPolicy::from_config(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(uids: &[u32], gids: &[u32], admins: &[u32]) -> AccessPolicy {
        AccessPolicy {
            allowed_uids: uids.to_vec(),
            allowed_gids: gids.to_vec(),
            admin_uids: admins.to_vec(),
        }
    }

    #[test]
    fn empty_lists_admit_anyone() {
        let p = policy(&[], &[], &[]);
        assert!(p.may_connect(0, 0));
        assert!(p.may_connect(12345, 54321));
        assert!(!p.may_admin(0), "empty admin list admits nobody");
    }

    #[test]
    fn uid_list_alone() {
        let p = policy(&[1000], &[], &[]);
        assert!(p.may_connect(1000, 1));
        assert!(
            !p.may_connect(1001, 1000),
            "gid list empty: gid does not admit"
        );
    }

    #[test]
    fn gid_list_alone() {
        let p = policy(&[], &[990], &[]);
        assert!(p.may_connect(5, 990));
        assert!(
            !p.may_connect(990, 5),
            "a uid equal to an allowed gid is not admitted"
        );
    }

    #[test]
    fn either_list_admits() {
        let p = policy(&[1000], &[990], &[]);
        assert!(p.may_connect(1000, 1));
        assert!(p.may_connect(2000, 990));
        assert!(!p.may_connect(2000, 1));
    }

    #[test]
    fn admin_is_by_uid_only() {
        let p = policy(&[], &[], &[0, 1000]);
        assert!(p.may_admin(0));
        assert!(p.may_admin(1000));
        assert!(!p.may_admin(1001));
    }

    #[test]
    fn from_config_copies_lists() {
        let mut c = SidecarConfig::default();
        assert_eq!(AccessPolicy::from_config(&c), policy(&[], &[], &[0]));
        c.allowed_uids = vec![7];
        c.allowed_gids = vec![8];
        c.admin_uids = vec![9];
        assert_eq!(AccessPolicy::from(&c), policy(&[7], &[8], &[9]));
    }

    #[tokio::test]
    async fn peer_of_reports_our_own_credentials() {
        let (a, b) = tokio::net::UnixStream::pair().unwrap();
        let uid = nix::unistd::geteuid().as_raw();
        let gid = nix::unistd::getegid().as_raw();
        for s in [&a, &b] {
            let p = peer_of(s).unwrap();
            assert_eq!((p.uid, p.gid), (uid, gid));
            if let Some(pid) = p.pid {
                assert_eq!(pid as u32, std::process::id());
            }
        }
    }
}
