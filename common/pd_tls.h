/* pd_tls.h - TLS material for the nodes' gRPC and HTTP endpoints and their gRPC clients.
 * Owns: reading and checking the PEM files named by --tls-cert, --tls-key and --tls-ca
 *   (OpenSSL parses them at start, so a wrong file fails the node with its name instead of
 *   failing every handshake later), and the OpenSSL server context the HTTP server hands each
 *   connection.
 * Not here: where TLS is applied (pd_rpc.c for gRPC servers and channels, pd_http.c for HTTP).
 * Threading: a pd_tls is immutable once loaded and may be shared by threads; pd_tls_ssl_ctx's
 *   context is OpenSSL's, thread-safe for SSL_new. */
#ifndef PD_TLS_H
#define PD_TLS_H

#include "pd_status.h"

typedef struct {
    char *cert_pem;   /* the certificate chain this process serves with (NULL: serve plaintext) */
    char *key_pem;    /* its private key */
    char *ca_pem;     /* roots a client of this process verifies servers against (NULL: connect
                       * in plaintext); with cert_pem, channels present that certificate */
    char *client_ca_pem;  /* roots the servers of this process require client certificates to
                           * chain to (mutual TLS; NULL: clients are not asked) */
} pd_tls;

/* Read and check the files: cert and key both or neither (a key that does not match the
 * certificate is refused), ca alone or with them, client_ca only with cert and key; NULL paths
 * leave that part out. Errors name the file and flag: PD_ERR_IO (cannot read), PD_ERR_INVALID
 * (not PEM of the right kind, key and certificate that do not match, only one of cert/key,
 * client_ca without a certificate to serve). */
pd_status pd_tls_load(const char *cert_path, const char *key_path, const char *ca_path,
                      const char *client_ca_path, pd_tls *out, pd_err *err);
void pd_tls_free(pd_tls *t);                 /* NULL or zeroed: no-op */
/* A TLS 1.2+ server context (SSL_CTX *) for t's certificate and key, for HTTP (with
 * client_ca_pem: a client certificate, when presented, must chain to it; pd_http refuses the
 * connections that present none outside its ops routes); NULL with *err
 * set when OpenSSL refuses them (PD_ERR_INVALID) or t serves no certificate. The caller frees
 * it with pd_tls_ssl_ctx_free. */
void *pd_tls_ssl_ctx(const pd_tls *t, pd_err *err);
void pd_tls_ssl_ctx_free(void *ctx);

#endif
