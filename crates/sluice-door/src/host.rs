//! Which `Host` a listener answers: one of its own addresses, `localhost`, or a name
//! the operator allowed. A page on `evil.example` that rebinds its name to 127.0.0.1
//! still sends `Host: evil.example`, so a name nobody allowed is the sign of DNS
//! rebinding (answered 421 Misdirected Request).
//!
//! The port is not compared: a tunnel (`ssh -L 1234:localhost:9090`) or a reverse
//! proxy changes it, and a rebinding page cannot choose the name it is sent under.

use std::net::{IpAddr, SocketAddr};

/// The names and addresses a listener answers to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostRule {
    listener: IpAddr,
    names: Vec<String>,
}

impl HostRule {
    /// The rule of a listener bound to `listener`, answering also to `names` (e.g.
    /// the name a reverse proxy forwards; compared without case, a trailing dot
    /// ignored).
    pub fn new(listener: SocketAddr, names: impl IntoIterator<Item = impl AsRef<str>>) -> Self {
        HostRule {
            listener: listener.ip(),
            names: names
                .into_iter()
                .map(|n| normal_name(n.as_ref()))
                .filter(|n| !n.is_empty())
                .collect(),
        }
    }

    /// Whether `authority` (a `Host` field or an HTTP/2 `:authority`) names this
    /// listener: `localhost`, an address the listener is bound to (any address when
    /// it is bound to all of them, `0.0.0.0` or `[::]`), or an allowed name.
    pub fn allows(&self, authority: &str) -> bool {
        let Some((host, _port)) = split_authority(authority) else {
            return false;
        };
        if let Some(ip) = host_ip(host) {
            return ip == self.listener
                || self.listener.is_unspecified()
                || (ip.is_loopback()
                    && self.listener.is_loopback()
                    && same_family(ip, self.listener));
        }
        let name = normal_name(host);
        name == "localhost" || self.names.contains(&name)
    }
}

fn same_family(a: IpAddr, b: IpAddr) -> bool {
    a.is_ipv4() == b.is_ipv4()
}

fn normal_name(name: &str) -> String {
    name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase()
}

/// The IP address a host part names, if it is a literal (`127.0.0.1`, `[::1]`).
fn host_ip(host: &str) -> Option<IpAddr> {
    match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) => v6.parse().ok(),
        None => host.parse().ok(),
    }
}

/// `host` and the port (if any) of an authority; `None` for an empty host, a
/// user-info part, or a port that is not a number.
pub(crate) fn split_authority(authority: &str) -> Option<(&str, Option<u16>)> {
    if authority.is_empty() || authority.contains(['@', '/', ' ', '\t']) {
        return None;
    }
    let (host, port) = if authority.starts_with('[') {
        let end = authority.find(']')?;
        let (host, rest) = authority.split_at(end + 1);
        match rest {
            "" => (host, None),
            _ => (host, Some(rest.strip_prefix(':')?)),
        }
    } else {
        match authority.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        }
    };
    if host.is_empty() {
        return None;
    }
    let port = match port {
        Some(p) => Some(p.parse::<u16>().ok()?),
        None => None,
    };
    Some((host, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(addr: &str, names: &[&str]) -> HostRule {
        HostRule::new(addr.parse().expect("an address"), names.iter().copied())
    }

    #[test]
    fn s2_a_loopback_listener_answers_its_address_and_localhost_only() {
        let r = rule("127.0.0.1:9090", &[]);
        for ok in [
            "127.0.0.1:9090",
            "127.0.0.1",
            "localhost:9090",
            "LOCALHOST",
            "localhost.:1234",
        ] {
            assert!(r.allows(ok), "{ok}");
        }
        for bad in [
            "evil.example:9090",
            "evil.example",
            "",
            "[::1]:9090",
            "10.0.0.1:9090",
            "127.0.0.1:x",
            "user@127.0.0.1",
            "localhost.evil.example",
        ] {
            assert!(!r.allows(bad), "{bad}");
        }
    }

    #[test]
    fn s2_a_listener_on_every_address_answers_any_literal_and_its_names() {
        let r = rule("0.0.0.0:9090", &["Admin.Example.COM"]);
        assert!(r.allows("10.1.2.3:9090"));
        assert!(r.allows("[::1]:9090"));
        assert!(r.allows("admin.example.com"));
        assert!(!r.allows("other.example.com"));
        let v6 = rule("[::1]:9090", &[]);
        assert!(v6.allows("[::1]:9090"));
        assert!(!v6.allows("127.0.0.1:9090"));
    }

    #[test]
    fn authorities_split_into_host_and_port() {
        assert_eq!(split_authority("a:80"), Some(("a", Some(80))));
        assert_eq!(split_authority("[::1]:80"), Some(("[::1]", Some(80))));
        assert_eq!(split_authority("[::1]"), Some(("[::1]", None)));
        assert_eq!(split_authority("[::1]x"), None);
        assert_eq!(split_authority(":80"), None);
        assert_eq!(split_authority("a:99999"), None);
    }
}
