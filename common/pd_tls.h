/* pd_tls.h - TLS material for the nodes' gRPC and HTTP endpoints and their gRPC clients.
 * Owns: reading and checking the PEM files named by --tls-cert, --tls-key and --tls-ca
 *   (OpenSSL parses them at start, so a wrong file fails the node with its name instead of
 *   failing every handshake later), and the OpenSSL server context the HTTP server hands each
 *   connection.
 *   A node's reloads: the files read again on SIGHUP and at an interval, the new material handed
 *   to whoever serves with it when it changed and passes the same checks (pd_tls_reloader).
 * Not here: where TLS is applied (pd_rpc.c for gRPC servers and channels, pd_http.c for HTTP),
 *   the node's signal wait (pd_cli_wait_stop).
 * Threading: a pd_tls is immutable once loaded and may be shared by threads; pd_tls_ssl_ctx's
 *   context is OpenSSL's, thread-safe for SSL_new. A pd_tls_reloader belongs to one thread (a
 *   node's main thread). */
#ifndef PD_TLS_H
#define PD_TLS_H

#include "pd_metrics.h"
#include "pd_status.h"

typedef struct {
    char *cert_pem;   /* the certificate chain this process serves with (NULL: serve plaintext) */
    char *key_pem;    /* its private key */
    char *ca_pem;     /* roots a client of this process verifies servers against (NULL: connect
                       * in plaintext); with cert_pem, channels present that certificate */
    char *client_ca_pem;  /* roots the servers of this process require client certificates to
                           * chain to (mutual TLS; NULL: clients are not asked) */
    char *path[4];    /* the files they were read from (cert, key, ca, client_ca; NULL where not
                       * given), for pd_tls_reload */
} pd_tls;

/* Read and check the files: cert and key both or neither (a key that does not match the
 * certificate is refused), ca alone or with them, client_ca only with cert and key; NULL paths
 * leave that part out. Errors name the file and flag: PD_ERR_IO (cannot read), PD_ERR_INVALID
 * (not PEM of the right kind, key and certificate that do not match, only one of cert/key,
 * client_ca without a certificate to serve). */
pd_status pd_tls_load(const char *cert_path, const char *key_path, const char *ca_path,
                      const char *client_ca_path, pd_tls *out, pd_err *err);
void pd_tls_free(pd_tls *t);                 /* NULL or zeroed: no-op */
/* Read t's files again with pd_tls_load's checks: 0 when every one holds what t holds; 1 with
 * *next loaded when any changed (the caller puts it in force and frees one of the two); -1 with
 * *err naming flag and file when they cannot be read or are refused (a certificate replaced but
 * its key not yet: t stays in force). */
int pd_tls_reload(const pd_tls *t, pd_tls *next, pd_err *err);
/* The served certificate's end of validity (notAfter) in Unix seconds; 0 without one. */
double pd_tls_not_after(const pd_tls *t);
/* A TLS 1.2+ server context (SSL_CTX *) for t's certificate and key, for HTTP (with
 * client_ca_pem: a client certificate, when presented, must chain to it; pd_http refuses the
 * connections that present none outside its ops routes); NULL with *err
 * set when OpenSSL refuses them (PD_ERR_INVALID) or t serves no certificate. The caller frees
 * it with pd_tls_ssl_ctx_free. */
void *pd_tls_ssl_ctx(const pd_tls *t, pd_err *err);
void pd_tls_ssl_ctx_free(void *ctx);

/* A node's TLS material kept current: Kubernetes rewrites a mounted Secret in place and
 * cert-manager renews certificates weeks before they expire, so a node reads its files again on
 * SIGHUP and every interval and, when they changed and pass the checks, hands them to apply
 * (which puts them in force for new connections: pd_rpc_set_tls, pd_http_set_tls); connections
 * already open keep the session they have. A failed read or a refused file is logged and counted
 * and the material in force stays. Metrics (m not NULL): pdspark_tls_reloads_total,
 * pdspark_tls_reload_errors_total, pdspark_tls_certificate_expiry_timestamp_seconds. */
typedef pd_status (*pd_tls_apply_fn)(void *ud, const pd_tls *next, pd_err *err);
typedef struct {
    pd_tls *tls;              /* borrowed: the material in force, replaced at each change */
    pd_tls_apply_fn apply;
    void *ud;
    const char *node;         /* "decode" / "prefill": the log's component */
    pd_metric *m_reloads, *m_errors, *m_expiry;
} pd_tls_reloader;

void pd_tls_reloader_init(pd_tls_reloader *r, const char *node, pd_tls *t, pd_metrics *m,
                          pd_tls_apply_fn apply, void *ud);
/* One check (hup: asked for by SIGHUP, logged even when nothing changed). Returns what
 * pd_tls_reload did: 1 changed and applied, 0 unchanged or no TLS, -1 refused or not applied. */
int pd_tls_reloader_check(pd_tls_reloader *r, int hup);
/* pd_tls_reloader_check for pd_cli_wait_stop's tick (r: a pd_tls_reloader) */
void pd_tls_reloader_tick(void *r, int hup);

#endif
