//! A throwaway CA and a server certificate for 127.0.0.1 and localhost,
//! written as PEM files, for the TLS tests (the control plane's and the
//! agent's and the target's).

use std::path::{Path, PathBuf};

/// PEM files in a directory: `ca.pem`, `server.pem`, `server.key`.
#[derive(Debug)]
pub struct Certs {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// A fresh CA in `dir` (files prefixed `name`) and a server certificate
/// it signs.
pub fn make(dir: &Path, name: &str) -> Certs {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(DnType::CommonName, format!("nvpool test CA {name}"));
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let leaf = CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
        .unwrap()
        .signed_by(&key, &ca_cert, &ca_key)
        .unwrap();
    let c = Certs {
        ca: dir.join(format!("{name}-ca.pem")),
        cert: dir.join(format!("{name}-server.pem")),
        key: dir.join(format!("{name}-server.key")),
    };
    std::fs::write(&c.ca, ca_cert.pem()).unwrap();
    std::fs::write(&c.cert, leaf.pem()).unwrap();
    std::fs::write(&c.key, key.serialize_pem()).unwrap();
    c
}
