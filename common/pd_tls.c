/* pd_tls.c - TLS files read and checked with OpenSSL, and the HTTP server's context (pd_tls.h). */
#include "pd_tls.h"

#include <stdlib.h>
#include <string.h>

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>

#include "pd_cli.h"

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
    if (client_ca_path != NULL && cert_path == NULL)
        return pd_err_set(err, PD_ERR_INVALID, "--tls-client-ca without --tls-cert/--tls-key: client "
                          "certificates are asked for over TLS only");
    if ((cert_path == NULL) != (key_path == NULL))
        return pd_err_set(err, PD_ERR_INVALID, "%s without %s: a served certificate needs its key",
                          cert_path != NULL ? "--tls-cert" : "--tls-key",
                          cert_path != NULL ? "--tls-key" : "--tls-cert");
    pd_status st = PD_OK;
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
    memset(t, 0, sizeof(*t));
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
