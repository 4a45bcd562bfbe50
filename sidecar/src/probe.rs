//! `--probe PATH`: one HTTP GET to this sidecar's own listener, for HEALTHCHECKs in images without curl.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(3);

/// Exit code: 0 when the answer is 200, 1 otherwise (printed on stderr).
pub fn run(listen: SocketAddr, path: &str) -> i32 {
    match status(connect_addr(listen), path) {
        Ok(200) => 0,
        Ok(code) => {
            eprintln!("{path}: HTTP {code}");
            1
        }
        Err(err) => {
            eprintln!("{path}: {err}");
            1
        }
    }
}

/// A wildcard listen address is reached through loopback.
fn connect_addr(listen: SocketAddr) -> SocketAddr {
    match listen.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => SocketAddr::new(Ipv4Addr::LOCALHOST.into(), listen.port()),
        IpAddr::V6(ip) if ip.is_unspecified() => SocketAddr::new(Ipv6Addr::LOCALHOST.into(), listen.port()),
        _ => listen,
    }
}

fn status(addr: SocketAddr, path: &str) -> std::io::Result<u16> {
    let mut stream = TcpStream::connect_timeout(&addr, TIMEOUT)?;
    stream.set_read_timeout(Some(TIMEOUT))?;
    stream.set_write_timeout(Some(TIMEOUT))?;
    // One write: write! on an unbuffered stream sends each piece of the format on its own, and a
    // server that answers after the first piece and closes makes the next one fail (EPIPE).
    stream.write_all(format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes())?;
    // The status line fits in the first read: "HTTP/1.1 200 OK".
    let mut head = [0u8; 64];
    let n = stream.read(&mut head)?;
    let line = String::from_utf8_lossy(&head[..n]);
    line.split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("not an HTTP answer: {line:?}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn serve_once(answer: &'static str) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let (mut request, mut chunk) = (Vec::new(), [0u8; 256]);
            while !request.ends_with(b"\r\n\r\n") {
                match conn.read(&mut chunk) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => request.extend_from_slice(&chunk[..n]),
                }
            }
            conn.write_all(answer.as_bytes()).unwrap();
        });
        addr
    }

    #[test]
    fn ok_only_on_200() {
        assert_eq!(run(serve_once("HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"), "/readyz"), 0);
        assert_eq!(run(serve_once("HTTP/1.1 503 Service Unavailable\r\n\r\n"), "/readyz"), 1);
        assert_eq!(run(serve_once("garbage"), "/readyz"), 1);
    }

    #[test]
    fn nothing_listening_is_a_failure() {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        assert_eq!(run(SocketAddr::from(([127, 0, 0, 1], port)), "/healthz"), 1);
    }

    #[test]
    fn wildcard_goes_to_loopback() {
        assert_eq!(connect_addr("0.0.0.0:8080".parse().unwrap()), "127.0.0.1:8080".parse().unwrap());
        assert_eq!(connect_addr("[::]:8080".parse().unwrap()), "[::1]:8080".parse().unwrap());
    }
}
