"""Identity and transport security: a local CA and certificates (pki), gRPC TLS credentials (tls) and the
per-method authorization of service identities (authz)."""
