//! The client's address: the TCP peer, or, when the peer is a proxy the
//! operator trusts (`--trusted-proxies`), the nearest `X-Forwarded-For` hop
//! that is not itself trusted. A client can write anything into the header;
//! only hops appended by trusted proxies are believed.

use std::net::{IpAddr, Ipv6Addr};
use std::str::FromStr;

use axum::http::HeaderMap;
use ipnet::IpNet;

use crate::flag_error::FlagError;

/// The CIDRs whose `X-Forwarded-For` is believed.
#[derive(Debug, Clone, Default)]
pub struct TrustedProxies(Vec<IpNet>);

impl TrustedProxies {
    /// Parses `--trusted-proxies` (CIDRs, or single addresses).
    pub fn parse(values: &[String]) -> Result<TrustedProxies, FlagError> {
        let mut nets = Vec::with_capacity(values.len());
        for v in values {
            let v = v.trim();
            // An empty setting (an unset environment variable) is none.
            if v.is_empty() {
                continue;
            }
            let net = IpNet::from_str(v)
                .or_else(|_| IpAddr::from_str(v).map(IpNet::from))
                .map_err(|_| {
                    FlagError::new(
                        "--trusted-proxies",
                        format!("{v:?} is not a CIDR (such as 10.0.0.0/8) or an IP address"),
                    )
                })?;
            nets.push(net);
        }
        Ok(TrustedProxies(nets))
    }

    fn trusts(&self, ip: IpAddr) -> bool {
        self.0.iter().any(|n| n.contains(&ip))
    }

    /// Whether a request from `peer` came through one of the proxies.
    pub fn trusts_peer(&self, peer: IpAddr) -> bool {
        self.trusts(canonical(peer))
    }

    /// The client address of a request from `peer` with `headers`.
    pub fn client(&self, peer: IpAddr, headers: &HeaderMap) -> IpAddr {
        let peer = canonical(peer);
        if !self.trusts(peer) {
            return peer;
        }
        // Hops, nearest last: each proxy appends the address it saw.
        let hops: Vec<&str> = headers
            .get_all("x-forwarded-for")
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .filter(|h| !h.is_empty())
            .collect();
        let mut client = peer;
        for hop in hops.iter().rev() {
            // What a trusted proxy could not read as an address stops the
            // walk: the last address believed is the client.
            let Some(ip) = parse_hop(hop) else { break };
            client = ip;
            if !self.trusts(ip) {
                break;
            }
        }
        client
    }
}

/// An IPv4-mapped IPv6 address as the IPv4 address it is.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    }
}

/// A hop as proxies write it: an address, `[v6]:port` or `v4:port`.
fn parse_hop(hop: &str) -> Option<IpAddr> {
    if let Ok(ip) = IpAddr::from_str(hop) {
        return Some(canonical(ip));
    }
    if let Some(rest) = hop.strip_prefix('[') {
        let (addr, _) = rest.split_once(']')?;
        return Ipv6Addr::from_str(addr).ok().map(|a| canonical(a.into()));
    }
    let (addr, port) = hop.rsplit_once(':')?;
    port.parse::<u16>().ok()?;
    IpAddr::from_str(addr).ok().map(canonical)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(xff: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in xff {
            h.append("x-forwarded-for", v.parse().unwrap());
        }
        h
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn the_header_is_believed_only_from_a_trusted_peer() {
        let t = TrustedProxies::parse(&["10.0.0.0/8".into(), "192.168.1.7".into()]).unwrap();
        let h = headers(&["203.0.113.9"]);
        assert_eq!(t.client(ip("198.51.100.1"), &h), ip("198.51.100.1"));
        assert_eq!(t.client(ip("10.1.2.3"), &h), ip("203.0.113.9"));
        assert_eq!(t.client(ip("192.168.1.7"), &h), ip("203.0.113.9"));
        // Nothing trusted: the peer, whatever the header says.
        let none = TrustedProxies::default();
        assert_eq!(none.client(ip("10.1.2.3"), &h), ip("10.1.2.3"));
    }

    #[test]
    fn a_forged_leftmost_hop_is_not_the_client() {
        let t = TrustedProxies::parse(&["10.0.0.0/8".into()]).unwrap();
        // The client wrote 1.1.1.1; the trusted proxy appended what it saw.
        let h = headers(&["1.1.1.1, 203.0.113.9, 10.0.0.5"]);
        assert_eq!(t.client(ip("10.0.0.6"), &h), ip("203.0.113.9"));
        // Split across headers, the order is the same.
        let h = headers(&["1.1.1.1", "203.0.113.9", "10.0.0.5"]);
        assert_eq!(t.client(ip("10.0.0.6"), &h), ip("203.0.113.9"));
    }

    #[test]
    fn garbage_and_ports_are_handled() {
        let t = TrustedProxies::parse(&["10.0.0.0/8".into()]).unwrap();
        assert_eq!(
            t.client(ip("10.0.0.6"), &headers(&["203.0.113.9, not-an-ip"])),
            ip("10.0.0.6"),
            "an unreadable hop stops the walk at the proxy that wrote it"
        );
        assert_eq!(
            t.client(ip("10.0.0.6"), &headers(&["203.0.113.9:4711"])),
            ip("203.0.113.9")
        );
        assert_eq!(
            t.client(ip("10.0.0.6"), &headers(&["[2001:db8::1]:443"])),
            ip("2001:db8::1")
        );
        assert_eq!(t.client(ip("10.0.0.6"), &headers(&[])), ip("10.0.0.6"));
        // Every hop trusted: the farthest one.
        assert_eq!(
            t.client(ip("10.0.0.6"), &headers(&["10.9.9.9, 10.0.0.5"])),
            ip("10.9.9.9")
        );
        assert_eq!(
            t.client(ip("::ffff:10.0.0.6"), &headers(&["203.0.113.9"])),
            ip("203.0.113.9"),
            "a v4-mapped peer is its v4 address"
        );
    }

    #[test]
    fn a_bad_flag_is_named() {
        assert!(TrustedProxies::parse(&["".into()]).unwrap().0.is_empty());
        let e = TrustedProxies::parse(&["10.0.0.0/33".into()]).unwrap_err();
        assert!(e.to_string().contains("--trusted-proxies"), "{e}");
        assert!(e.to_string().contains("10.0.0.0/33"), "{e}");
    }
}
