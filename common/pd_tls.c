/* pd_tls.c - TLS files read and checked with OpenSSL, the HTTP server's context, and a node's
 * reloads of them (pd_tls.h). */
#include "pd_tls.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>

#include "pd_cli.h"
#include "pd_log.h"

/* OpenSSL's most recent error as text, the queue cleared */
static const char *ossl_reason(char *buf, size_t cap)
{
    unsigned long e = ERR_get_error();
    ERR_clear_error();
    if (e == 0)
        return "no PEM block of that kind";
    ERR_error_string_n(e, buf, cap);
    return buf;
}

/* The certificates in pem: how many, or -1 with *err (the first must parse; a PEM with none is
 * refused) */
static int count_certs(const char *pem, const char *what, const char *path, pd_err *err)
{
    BIO *b = BIO_new_mem_buf(pem, -1);
    if (b == NULL)
        return pd_err_set(err, PD_ERR_NOMEM, "%s %s: OpenSSL buffer", what, path), -1;
    int n = 0;
    X509 *x;
    while ((x = PEM_read_bio_X509(b, NULL, NULL, NULL)) != NULL) {
        X509_free(x);
        n++;
    }
    char why[256];
    const char *reason = ossl_reason(why, sizeof(why));   /* the end of input, after the last */
    BIO_free(b);
    if (n == 0)
        pd_err_set(err, PD_ERR_INVALID, "%s %s: no PEM certificate (%s)", what, path, reason);
    return n > 0 ? n : -1;
}

/* path's text into *pem, checked to hold certificates; flag names it in errors */
static pd_status load_certs(const char *flag, const char *path, char **pem, pd_err *err)
{
    pd_status st = pd_cli_read_text(path, pem, err);
    if (st != PD_OK)
        return pd_err_prefix(err, "%s", flag);
    if (count_certs(*pem, flag, path, err) < 0)
        return err != NULL ? err->code : PD_ERR_INVALID;
    return PD_OK;
}

pd_status pd_tls_load(const char *cert_path, const char *key_path, const char *ca_path,
                      const char *client_ca_path, pd_tls *out, pd_err *err)
{
    memset(out, 0, sizeof(*out));
    const char *paths[4] = {cert_path, key_path, ca_path, client_ca_path};
    if (client_ca_path != NULL && cert_path == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "--tls-client-ca without --tls-cert/--tls-key: client "
                          "certificates are asked for over TLS only");
    if ((cert_path == NULL) != (key_path == NULL))
        return pd_err_set(err, PD_ERR_INVALID, "%s without %s: a served certificate needs its key",
                          cert_path != NULL ? "--tls-cert" : "--tls-key",
                          cert_path != NULL ? "--tls-key" : "--tls-cert");
    pd_status st = PD_OK;
    for (int i = 0; i < 4; i++)
        if (paths[i] != NULL && (out->path[i] = strdup(paths[i])) == NULL) {
            st = pd_err_set(err, PD_ERR_NOMEM, "TLS file names");
            goto fail;
        }
    if (key_path != NULL && (st = pd_cli_read_text(key_path, &out->key_pem, err)) != PD_OK) {
        pd_err_prefix(err, "--tls-key");
        goto fail;
    }
    if ((cert_path != NULL && (st = load_certs("--tls-cert", cert_path, &out->cert_pem, err)) != PD_OK) ||
        (ca_path != NULL && (st = load_certs("--tls-ca", ca_path, &out->ca_pem, err)) != PD_OK) ||
        (client_ca_path != NULL &&
         (st = load_certs("--tls-client-ca", client_ca_path, &out->client_ca_pem, err)) != PD_OK))
        goto fail;
    if (cert_path != NULL) {
        /* the key parses and belongs to the certificate (and the client roots load): the
         * context the HTTP server will make takes them all */
        void *ctx = pd_tls_ssl_ctx(out, err);
        if (ctx == NULL) {
            st = err != NULL ? err->code : PD_ERR_INVALID;
            pd_err_prefix(err, "--tls-cert %s / --tls-key %s", cert_path, key_path);
            goto fail;
        }
        pd_tls_ssl_ctx_free(ctx);
    }
    return PD_OK;
fail:
    pd_tls_free(out);
    return st;
}

void pd_tls_free(pd_tls *t)
{
    if (t == NULL)
        return;
    free(t->cert_pem);
    free(t->key_pem);
    free(t->ca_pem);
    free(t->client_ca_pem);
    for (int i = 0; i < 4; i++)
        free(t->path[i]);
    memset(t, 0, sizeof(*t));
}

static int same_text(const char *a, const char *b)
{
    return (a == NULL && b == NULL) || (a != NULL && b != NULL && strcmp(a, b) == 0);
}

int pd_tls_reload(const pd_tls *t, pd_tls *next, pd_err *err)
{
    /* the files as they are: unchanged ones need no OpenSSL checks (the interval's usual case) */
    const char *const in_force[4] = {t->cert_pem, t->key_pem, t->ca_pem, t->client_ca_pem};
    int same = 1;
    for (int i = 0; i < 4 && same; i++) {
        char *now = NULL;
        pd_err e;
        same = t->path[i] == NULL || (pd_cli_read_text(t->path[i], &now, &e) == PD_OK && same_text(now, in_force[i]));
        free(now);
    }
    if (same)
        return 0;
    if (pd_tls_load(t->path[0], t->path[1], t->path[2], t->path[3], next, err) != PD_OK)
        return -1;
    return 1;
}

double pd_tls_not_after(const pd_tls *t)
{
    if (t->cert_pem == NULL)
        return 0;
    BIO *b = BIO_new_mem_buf(t->cert_pem, -1);
    X509 *x = b != NULL ? PEM_read_bio_X509(b, NULL, NULL, NULL) : NULL;
    struct tm tm;
    double v = 0;
    if (x != NULL && ASN1_TIME_to_tm(X509_get0_notAfter(x), &tm) == 1)
        v = (double)timegm(&tm);
    ERR_clear_error();
    X509_free(x);
    BIO_free(b);
    return v;
}

void *pd_tls_ssl_ctx(const pd_tls *t, pd_err *err)
{
    if (t->cert_pem == NULL || t->key_pem == NULL) {
        pd_err_set(err, PD_ERR_INVALID, "no certificate to serve");
        return NULL;
    }
    char why[256];
    SSL_CTX *ctx = SSL_CTX_new(TLS_server_method());
    BIO *cb = BIO_new_mem_buf(t->cert_pem, -1), *kb = BIO_new_mem_buf(t->key_pem, -1);
    X509 *leaf = NULL;
    EVP_PKEY *key = NULL;
    const char *fail = NULL;
    if (ctx == NULL || cb == NULL || kb == NULL) {
        fail = "OpenSSL context";
        goto out;
    }
    SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
    if ((leaf = PEM_read_bio_X509(cb, NULL, NULL, NULL)) == NULL ||
        SSL_CTX_use_certificate(ctx, leaf) != 1) {
        fail = "certificate";
        goto out;
    }
    X509 *extra;   /* the rest of the chain, intermediates first */
    while ((extra = PEM_read_bio_X509(cb, NULL, NULL, NULL)) != NULL)
        if (SSL_CTX_add_extra_chain_cert(ctx, extra) != 1) {   /* takes extra on success */
            X509_free(extra);
            fail = "certificate chain";
            goto out;
        }
    ERR_clear_error();   /* the end of the chain */
    if ((key = PEM_read_bio_PrivateKey(kb, NULL, NULL, NULL)) == NULL) {
        fail = "no private key (PEM, unencrypted)";
        goto out;
    }
    if (SSL_CTX_use_PrivateKey(ctx, key) != 1 || SSL_CTX_check_private_key(ctx) != 1) {
        fail = "the private key does not match the certificate";
        goto out;
    }
    if (t->client_ca_pem != NULL) {
        /* mutual TLS: a client without a certificate that chains to these roots is refused */
        BIO *rb = BIO_new_mem_buf(t->client_ca_pem, -1);
        X509_STORE *store = SSL_CTX_get_cert_store(ctx);
        X509 *root;
        int n = 0;
        while (rb != NULL && (root = PEM_read_bio_X509(rb, NULL, NULL, NULL)) != NULL) {
            n += X509_STORE_add_cert(store, root) == 1;
            X509_free(root);
        }
        BIO_free(rb);
        ERR_clear_error();
        if (n == 0) {
            fail = "client roots";
            goto out;
        }
        /* a client that presents a certificate must chain to the roots (else the handshake
         * fails); one that presents none is let in, and the HTTP server refuses it on every
         * route but /health, /ready and /metrics (probes and scrapers carry no certificate) */
        SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, NULL);
    }
out:
    if (fail != NULL) {
        pd_err_set(err, ctx == NULL || cb == NULL || kb == NULL ? PD_ERR_NOMEM : PD_ERR_INVALID,
                   "%s (%s)", fail, ossl_reason(why, sizeof(why)));
        SSL_CTX_free(ctx);
        ctx = NULL;
    }
    X509_free(leaf);
    EVP_PKEY_free(key);
    BIO_free(cb);
    BIO_free(kb);
    return ctx;
}

void pd_tls_ssl_ctx_free(void *ctx)
{
    SSL_CTX_free(ctx);
}

void pd_tls_reloader_init(pd_tls_reloader *r, const char *node, pd_tls *t, pd_metrics *m,
                          pd_tls_apply_fn apply, void *ud)
{
    memset(r, 0, sizeof(*r));
    r->tls = t;
    r->apply = apply;
    r->ud = ud;
    r->node = node;
    if (m == NULL || (t->path[0] == NULL && t->path[2] == NULL))
        return;
    r->m_reloads = pd_metrics_counter(m, "pdspark_tls_reloads_total",
                                      "TLS files read again and put in force after they changed "
                                      "(SIGHUP or --tls-reload-interval)", NULL);
    r->m_errors = pd_metrics_counter(m, "pdspark_tls_reload_errors_total",
                                     "TLS reloads refused (unreadable or mismatched files; the "
                                     "material in force stays)", NULL);
    if (t->cert_pem != NULL) {
        r->m_expiry = pd_metrics_gauge(m, "pdspark_tls_certificate_expiry_timestamp_seconds",
                                       "End of validity (notAfter) of the served certificate, "
                                       "Unix seconds", NULL);
        pd_metric_set(r->m_expiry, pd_tls_not_after(t));
    }
}

int pd_tls_reloader_check(pd_tls_reloader *r, int hup)
{
    if (r->tls->path[0] == NULL && r->tls->path[2] == NULL) {
        if (hup)
            PD_LOG_INFO(r->node, "SIGHUP: no TLS files to read again");
        return 0;
    }
    pd_tls next;
    pd_err err = {0};
    int rc = pd_tls_reload(r->tls, &next, &err);
    if (rc == 1 && r->apply(r->ud, &next, &err) != PD_OK) {
        pd_tls_free(&next);
        rc = -1;
    }
    if (rc < 0) {
        pd_metric_inc(r->m_errors);
        PD_LOG_WARN(r->node, "TLS reload%s refused, the files read before stay in force: %s",
                    hup ? " (SIGHUP)" : "", err.msg);
        return -1;
    }
    if (rc == 0) {
        if (hup)
            PD_LOG_INFO(r->node, "SIGHUP: the TLS files are unchanged");
        return 0;
    }
    pd_tls_free(r->tls);
    *r->tls = next;
    pd_metric_inc(r->m_reloads);
    double na = pd_tls_not_after(r->tls);
    pd_metric_set(r->m_expiry, na);
    char when[32] = "-";
    time_t tt = (time_t)na;
    struct tm tm;
    if (na > 0 && gmtime_r(&tt, &tm) != NULL)
        strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%SZ", &tm);
    PD_LOG_INFO(r->node, "TLS files read again%s and in force for new connections (certificate "
                "valid until %s)", hup ? " (SIGHUP)" : "", when);
    return 1;
}

void pd_tls_reloader_tick(void *r, int hup)
{
    pd_tls_reloader_check(r, hup);
}
