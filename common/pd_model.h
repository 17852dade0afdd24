/* pd_model.h - model shapes: the Qwen3 target and the DSpark drafter configs, and the weights.
 * Owns: the config structs (parsed from config.json / generation_config.json), the weight
 *   structs, loading them from a checkpoint onto a backend, and the checks that a draft fits
 *   its target.
 * Not here: the forward passes (pd_qwen3.c, pd_dspark.c), KV layout (pd_kv.h).
 * Threading: a loaded model is immutable and may be shared by threads using one backend. */
#ifndef PD_MODEL_H
#define PD_MODEL_H

#include <stdint.h>

#include "kern_backend.h"
#include "pd_status.h"

#define PD_MAX_EOS 8
#define PD_MAX_TAPS 16

typedef struct {
    char arch[64];                /* architectures[0] */
    int vocab_size;
    int hidden_size;
    int intermediate_size;
    int num_hidden_layers;
    int num_attention_heads;
    int num_key_value_heads;
    int head_dim;                 /* head_dim, or hidden_size / num_attention_heads */
    float rms_norm_eps;
    float rope_theta;             /* rope_parameters.rope_theta or rope_theta */
    kern_rope_scaling rope_scaling;   /* rope_parameters / rope_scaling: default (zero), linear
                                       * or yarn, with yarn's ramp and attention factor formed */
    int max_position_embeddings;
    int tie_word_embeddings;
    int attention_bias;           /* refused when true: Qwen3 has none */
    int eos_ids[PD_MAX_EOS];      /* generation_config.json eos_token_id, else config.json */
    int n_eos;
    int bos_id;                   /* -1 when absent */
    int pad_id;                   /* -1 when absent */
} pd_qwen3_config;

typedef enum { PD_MARKOV_NONE = 0, PD_MARKOV_VANILLA, PD_MARKOV_GATED, PD_MARKOV_RNN } pd_markov_type;

typedef struct {
    pd_qwen3_config base;         /* draft layer shapes; base.num_hidden_layers = draft layers */
    int block_size;
    int mask_token_id;
    int target_layer_ids[PD_MAX_TAPS];
    int n_target_layers;          /* K: aux is [T, K * hidden] */
    int num_target_layers;        /* the target's layer count as recorded by DeepSpec, 0 if absent */
    int markov_rank;              /* 0 = no Markov head */
    pd_markov_type markov_type;
    int enable_confidence_head;
    int confidence_head_with_markov;
} pd_dspark_config;

/* Parse <dir>/config.json (+ generation_config.json when present). Errors name the file and
 * field: PD_ERR_IO (missing file), PD_ERR_INVALID (bad JSON, missing or out-of-range field). */
pd_status pd_qwen3_config_load(const char *dir, pd_qwen3_config *out, pd_err *err);
pd_status pd_dspark_config_load(const char *dir, pd_dspark_config *out, pd_err *err);
/* Checks a draft fits a target: vocab, hidden size, head dims, tap layers < target layers and
 * not the final layer, mask token inside the vocab. PD_ERR_INVALID with both values named. */
pd_status pd_dspark_config_check_target(const pd_dspark_config *d, const pd_qwen3_config *t,
                                        pd_err *err);

/* ---- weights ----------------------------------------------------------------------------- */

typedef struct {
    kern_weight input_norm, post_norm;       /* [hidden] */
    kern_weight q_proj, k_proj, v_proj, o_proj;
    kern_weight q_norm, k_norm;              /* [head_dim] */
    kern_weight gate_proj, up_proj, down_proj;
} pd_layer_weights;

typedef struct pd_qwen3_model {
    pd_qwen3_config cfg;
    kern_backend *be;                        /* borrowed */
    kern_buf *storage;                       /* one allocation holds every weight */
    kern_weight embed;                       /* [vocab, hidden] */
    kern_weight lm_head;                     /* [vocab, hidden]; == embed when tied */
    kern_weight final_norm;
    pd_layer_weights *layers;                /* [num_hidden_layers] */
} pd_qwen3_model;

typedef struct pd_dspark_model {
    pd_dspark_config cfg;
    kern_backend *be;                        /* borrowed */
    kern_buf *storage;
    kern_weight embed;                       /* own, or the target's (borrowed) */
    kern_weight lm_head;                     /* own, or the target's (borrowed) */
    kern_weight fc;                          /* [hidden, K * hidden] */
    kern_weight hidden_norm, final_norm;
    pd_layer_weights *layers;
    kern_weight markov_w1;                   /* [vocab, rank] */
    kern_weight markov_w2;                   /* [vocab, rank] */
    kern_weight gate_w, gate_b;              /* gated: [rank, hidden + rank], [rank] */
    kern_weight joint_w, joint_b;            /* rnn: [3 rank, 2 rank + hidden], [3 rank] */
    kern_weight conf_w, conf_b;              /* [1, hidden (+ rank)], [1]; data NULL if no head */
} pd_dspark_model;

/* Loads a target checkpoint dir onto be (weights converted to be->weight_dtype). Every tensor's
 * shape is checked against the config; errors name the file and the tensor. */
pd_status pd_qwen3_load(kern_backend *be, const char *dir, pd_qwen3_model **out, pd_err *err);
void pd_qwen3_free(pd_qwen3_model *m);

/* Loads a DSpark checkpoint dir. embed_tokens/lm_head come from the draft checkpoint when
 * present, else they are borrowed from target (which must outlive the draft). */
pd_status pd_dspark_load(kern_backend *be, const char *dir, const pd_qwen3_model *target,
                         pd_dspark_model **out, pd_err *err);
void pd_dspark_free(pd_dspark_model *m);

/* ---- synthetic models (benchmarks) ----------------------------------------------------- */

/* A target with the real shapes of name ("qwen3-4b": hidden 2560, 36 layers, 32/8 heads,
 * head_dim 128, intermediate 9728, tied embeddings; "qwen3-8b": hidden 4096, intermediate 12288,
 * untied lm_head; both vocab 151936, rope 1e6, max positions 40960) and random weights drawn
 * from seed: every matrix W[r, c] uniform-ish in +-[0.5, 2) / sqrt(c) in bf16 terms, every norm
 * weight 1, so activations stay finite through all layers. Weights are generated on the host in
 * chunks and uploaded (no download, nothing read from disk). PD_ERR_INVALID for an unknown name,
 * PD_ERR_NOMEM / PD_ERR_CUDA when the backend cannot hold the weights. */
pd_status pd_qwen3_synthetic(kern_backend *be, const char *name, uint64_t seed,
                             pd_qwen3_model **out, pd_err *err);
/* A DSpark drafter for target (borrowed; must outlive it and share be): n_layers draft layers of
 * the target's shapes, block_size B, K = 3 taps spread over the target (1, L/2 - 1, L - 3:
 * [1, 17, 33] for 36 layers), vanilla Markov head of rank 64, confidence head with Markov input,
 * embed_tokens/lm_head borrowed from the target, random weights from seed as above. */
pd_status pd_dspark_synthetic(kern_backend *be, const pd_qwen3_model *target, int n_layers,
                              int block_size, uint64_t seed, pd_dspark_model **out, pd_err *err);

#endif
