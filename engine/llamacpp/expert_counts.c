// llama.cpp's eval callback (cb_eval) that counts the routers' picks, in C: llama.cpp asks the callback about every
// node of every graph, and a Python callback costs microseconds a node. engine/llamacpp/expert_counts.py builds
// this file, fills a `counter` and passes `moedesk_count_experts` with it; the ggml functions come as pointers from
// the library llama-cpp-python loaded, so nothing here links against ggml. A step the counter skips (weight 0)
// declines every node when llama.cpp asks, so llama.cpp computes that step's graph in one piece.
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

// The first fields of ggml.h's struct ggml_tensor, up to its sources (GGML_MAX_OP_PARAMS 64, GGML_MAX_SRC 10).
struct tensor_head {
    int type;
    void *buffer;
    int64_t ne[4];
    size_t nb[4];
    int op;
    int32_t op_params[16];
    int32_t flags;
    const struct tensor_head *src[10];
};

enum { GGML_TYPE_I32 = 26 };
static const char PREFIX[] = "ffn_moe_topk-";

struct counter {
    const char *(*get_name)(const void *tensor);
    size_t (*nbytes)(const void *tensor);
    void (*tensor_get)(const void *tensor, void *data, size_t offset, size_t size);
    int64_t layers, experts;
    int64_t *counts;  // [layers][experts], owned by the caller
    int64_t *tokens;  // [layers]
    int64_t errors;   // nodes that could not be read (wrong type, layer or expert id out of range)
    char *scratch;    // the node's bytes, grown as needed; freed by moedesk_counter_free
    size_t scratch_bytes;
    int64_t weight;   // what each pick of this step adds: the steps it stands for, 0 to skip the step
    int64_t reads;    // nodes read (each one cut llama.cpp's graph there)
    const char *(*op_desc)(const void *tensor);
    int64_t gpu_weight;      // the same for the layers whose experts are on the GPU (sampled more thinly)
    const uint8_t *on_gpu;   // [layers]: 1 where the layer's experts are on the GPU
};

// The layer of a node named ffn_moe_topk-<layer>, or -1.
static int64_t topk_layer(const char *name) {
    if (name == NULL || strncmp(name, PREFIX, sizeof PREFIX - 1) != 0) return -1;
    const char *digits = name + sizeof PREFIX - 1;
    if (*digits == 0) return -1;
    int64_t layer = 0;
    for (; *digits; digits++) {
        if (*digits < '0' || *digits > '9') return -1;
        layer = layer * 10 + (*digits - '0');
    }
    return layer;
}

// The layer whose router's choice a node named `name` holds: ffn_moe_topk-<layer> itself, or the scheduler's copy
// of it in another backend's split, "<backend>#ffn_moe_topk-<layer>#<copy>"; -1 for any other name.
static int64_t ids_layer(const char *name) {
    if (name == NULL) return -1;
    const char *hash = strchr(name, '#');
    if (hash == NULL) return topk_layer(name);
    char inner[64];
    const char *end = strchr(hash + 1, '#');
    size_t n = end ? (size_t)(end - hash - 1) : strlen(hash + 1);
    if (n >= sizeof inner) return -1;
    memcpy(inner, hash + 1, n);
    inner[n] = 0;
    return topk_layer(inner);
}

static bool starts_with(const char *name, const char *prefix) {
    return strncmp(name, prefix, strlen(prefix)) == 0;
}

// Where a layer's picks are read: its experts' first matrix product (ffn_moe_up, or ffn_moe_gate_up where the two
// are one tensor), a MUL_MAT_ID whose ids (src[2]) are the router's choice. That node runs where the experts are,
// so for experts in RAM the graph is cut in a CPU split, where the ids are the scheduler's host copy: a cut in a GPU
// split makes ggml-cuda see that split's graph change, run it eagerly and capture it again on the steps after.
// The layer and the ids tensor, or -1.
static int64_t read_at(const struct counter *c, const void *tensor, const struct tensor_head **ids) {
    const char *name = c->get_name(tensor);
    if (name == NULL || !(starts_with(name, "ffn_moe_up") || starts_with(name, "ffn_moe_gate_up"))) return -1;
    const char *op = c->op_desc(tensor);
    const struct tensor_head *t = tensor;
    if (op == NULL || strcmp(op, "MUL_MAT_ID") != 0 || t->src[2] == NULL) return -1;
    *ids = t->src[2];
    return ids_layer(c->get_name(t->src[2]));
}

bool moedesk_count_experts(void *tensor, bool ask, void *user_data) {
    struct counter *c = user_data;
    if (ask && c->weight == 0 && c->gpu_weight == 0) return false;
    const struct tensor_head *t = NULL;
    int64_t layer = read_at(c, tensor, &t);
    if (layer < 0) return false;
    int64_t weight = layer < c->layers && c->on_gpu[layer] ? c->gpu_weight : c->weight;
    if (ask) return weight > 0;
    if (weight == 0) return true;  // not asked for this step; false while computing would stop the graph
    if (t->type != GGML_TYPE_I32 || layer >= c->layers || t->ne[2] * t->ne[3] != 1) {
        c->errors++;
        return true;  // false would stop the graph
    }
    size_t size = c->nbytes(t);
    if (size > c->scratch_bytes) {
        char *grown = realloc(c->scratch, size);
        if (grown == NULL) { c->errors++; return true; }
        c->scratch = grown, c->scratch_bytes = size;
    }
    c->reads++;
    c->tensor_get(t, c->scratch, 0, size);  // copied from the GPU where the experts run there
    int64_t *row = c->counts + layer * c->experts;
    // [top-k, tokens]: a token's ids sit nb[1] bytes apart (a view of every expert's sorted ids).
    for (int64_t token = 0; token < t->ne[1]; token++) {
        const char *ids = c->scratch + token * t->nb[1];
        for (int64_t j = 0; j < t->ne[0]; j++) {
            int32_t id;
            memcpy(&id, ids + j * t->nb[0], sizeof id);
            if (id >= 0 && id < c->experts) row[id] += weight;
            else c->errors++;
        }
    }
    c->tokens[layer] += t->ne[1] * weight;
    return true;
}

void moedesk_counter_free(struct counter *c) {
    free(c->scratch);
    c->scratch = NULL, c->scratch_bytes = 0;
}
