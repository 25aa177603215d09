// llama.cpp's log callback in C, in front of moedesk's Python one (engine/llamacpp/library.py). ggml-cuda logs a
// debug line each time it replays a split's CUDA graph: every GPU split of every decode step. Through Python each
// such line takes the GIL inside llama_decode. A thread that marked itself quiet (the thread that decodes) has its
// debug lines, and their continuations, dropped here; every other line, and every line of other threads (a load's
// debug lines name the tensors its overrides moved), goes on to Python.
#include <stdbool.h>

enum { LEVEL_DEBUG = 1, LEVEL_CONT = 5 };  // ggml.h's enum ggml_log_level

struct forward {
    void (*log)(int level, const char *text, void *user_data);
    void *user_data;
};

static __thread bool quiet, dropping;

void moedesk_log_quiet(bool on) {
    quiet = on;
}

void moedesk_log(int level, const char *text, void *user_data) {
    if (level != LEVEL_CONT) dropping = quiet && level == LEVEL_DEBUG;
    if (dropping) return;
    const struct forward *f = user_data;
    f->log(level, text, f->user_data);
}
