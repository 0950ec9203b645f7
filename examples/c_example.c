/* c_example.c — embedding kda-engine from plain C99 through kda/kda_engine.h.
 *
 *   kda-c-example MODEL.yaml      (e.g. examples/models/tiny.yaml)
 *
 * Creates a CPU engine, prints its memory plan's size, acquires a state slot, prefills a few tokens
 * of random bf16 inputs through every KDA layer, forks the sequence into a second slot, runs two
 * decode steps on both (the same outputs, bit for bit), and shows how errors come back (a bad YAML
 * string, a layer out of range). Exits 0 when everything behaved as expected. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kda/kda_engine.h"

enum { kPrefillTokens = 8, kDecodeSteps = 2 };

/* Prints the failure and jumps to cleanup; `engine` may be NULL. */
#define CHECK(call)                                                             \
  do {                                                                          \
    kda_status check_status_ = (call);                                          \
    if (check_status_ != KDA_OK) {                                              \
      fprintf(stderr, "kda-c-example: %s failed: %s: %s\n", #call,              \
              kda_status_string(check_status_), kda_engine_last_error(engine)); \
      goto done;                                                                \
    }                                                                           \
  } while (0)

/* float -> bf16 bits, round to nearest even (the inputs here are finite). */
static uint16_t to_bf16(float value) {
  uint32_t bits;
  memcpy(&bits, &value, sizeof bits);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return (uint16_t)(bits >> 16);
}

static float from_bf16(uint16_t value) {
  uint32_t bits = (uint32_t)value << 16;
  float result;
  memcpy(&result, &bits, sizeof result);
  return result;
}

/* xorshift64*: a seeded generator, so every run sees the same inputs. */
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static float uniform_symmetric(void) { /* in [-1, 1) */
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return (float)((rng_state * 0x2545f4914f6cdd1dull) >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

static uint16_t* random_bf16(size_t count) {
  uint16_t* values = (uint16_t*)malloc(count * sizeof *values);
  size_t i;
  if (values == NULL) return NULL;
  for (i = 0; i < count; ++i) values[i] = to_bf16(uniform_symmetric());
  return values;
}

int main(int argc, char** argv) {
  kda_engine* engine = NULL;
  kda_engine_options options;
  char err[512];
  int exit_code = 1;
  int num_layers = 0, slot = -1, fork = -1, layer, step;
  int64_t heads = 0, head_dim = 0;
  uint64_t arena_bytes = 0;
  size_t json_length = 0, width, i;
  uint16_t *q = NULL, *k = NULL, *v = NULL, *g = NULL, *beta = NULL, *out = NULL, *out_fork = NULL;
  int64_t cu_seqlens[2] = {0, kPrefillTokens};
  double checksum = 0.0;

  if (argc != 2) {
    fprintf(stderr, "usage: %s MODEL.yaml\n", argv[0]);
    return 2;
  }

  /* An error before there is a handle: the message comes back in `err`. */
  if (kda_engine_create_from_string("hidden_size: [not, a, number]\n", NULL, &engine, err,
                                    sizeof err) == KDA_OK ||
      engine != NULL) {
    fprintf(stderr, "kda-c-example: a bad YAML string was accepted\n");
    goto done;
  }
  printf("expected error (bad YAML string): %s\n", err);

  CHECK(kda_engine_options_init(&options));
  options.backend = KDA_BACKEND_CPU; /* host pointers below */
  options.cpu_threads = 2;
  options.seed = 1;
  if (kda_engine_create_from_file(argv[1], &options, &engine, err, sizeof err) != KDA_OK) {
    fprintf(stderr, "kda-c-example: cannot create the engine: %s\n", err);
    goto done;
  }

  CHECK(kda_engine_num_layers(engine, &num_layers));
  CHECK(kda_engine_num_heads(engine, &heads));
  CHECK(kda_engine_head_dim(engine, &head_dim));
  CHECK(kda_engine_arena_bytes(engine, &arena_bytes));
  CHECK(kda_engine_plan_json(engine, NULL, 0, &json_length));
  printf("engine: %d KDA layers, %lld heads of %lld, arena %llu bytes (plan JSON %lu bytes)\n",
         num_layers, (long long)heads, (long long)head_dim, (unsigned long long)arena_bytes,
         (unsigned long)json_length);

  /* One buffer per input, big enough for the prefill (decode uses the first token of each). */
  width = (size_t)(heads * head_dim);
  q = random_bf16(kPrefillTokens * width);
  k = random_bf16(kPrefillTokens * width);
  v = random_bf16(kPrefillTokens * width);
  g = random_bf16(kPrefillTokens * width);
  beta = random_bf16(kPrefillTokens * (size_t)heads);
  out = (uint16_t*)calloc(kPrefillTokens * width, sizeof *out);
  out_fork = (uint16_t*)calloc(width, sizeof *out_fork);
  if (!q || !k || !v || !g || !beta || !out || !out_fork) {
    fprintf(stderr, "kda-c-example: out of memory\n");
    goto done;
  }

  CHECK(kda_engine_acquire_slot(engine, &slot));
  /* A real model feeds layer l's output through the rest of the block into layer l + 1; here every
   * layer sees the same inputs. */
  for (layer = 0; layer < num_layers; ++layer) {
    CHECK(kda_engine_prefill(engine, layer, q, k, v, g, beta, out, &slot, 1, cu_seqlens));
  }
  /* A fork: the prefilled sequence's states copied into a slot of its own, in every layer (a
   * shared prompt prefix, parallel sampling). Both then decode the same tokens. */
  CHECK(kda_engine_acquire_slot(engine, &fork));
  CHECK(kda_engine_copy_slot(engine, slot, fork));
  for (step = 0; step < kDecodeSteps; ++step) {
    for (layer = 0; layer < num_layers; ++layer) {
      CHECK(kda_engine_decode(engine, layer, q, k, v, g, beta, out, &slot, 1, 1));
      CHECK(kda_engine_decode(engine, layer, q, k, v, g, beta, out_fork, &fork, 1, 1));
    }
  }
  CHECK(kda_engine_synchronize(engine));
  if (memcmp(out, out_fork, width * sizeof *out) != 0) {
    fprintf(stderr, "kda-c-example: the fork decoded other values than its source\n");
    goto done;
  }
  printf("the fork on slot %d decoded the same %d steps bit for bit\n", fork, kDecodeSteps);
  for (i = 0; i < width; ++i) {
    const float value = from_bf16(out[i]);
    if (!isfinite(value)) {
      fprintf(stderr, "kda-c-example: out[%lu] is not finite\n", (unsigned long)i);
      goto done;
    }
    checksum += fabs(value);
  }
  printf(
      "prefill of %d tokens + %d decode steps on slot %d: sum |out| of the last decode step = "
      "%.6f\n",
      kPrefillTokens, kDecodeSteps, slot, checksum);

  /* An error on a handle: the status says what kind, kda_engine_last_error() says what. */
  if (kda_engine_decode(engine, num_layers, q, k, v, g, beta, out, &slot, 1, 1) !=
      KDA_INVALID_ARGUMENT) {
    fprintf(stderr, "kda-c-example: a layer out of range was accepted\n");
    goto done;
  }
  printf("expected error (layer %d): %s\n", num_layers, kda_engine_last_error(engine));

  CHECK(kda_engine_release_slot(engine, fork));
  CHECK(kda_engine_release_slot(engine, slot));
  exit_code = 0;

done:
  kda_engine_destroy(engine);
  free(q);
  free(k);
  free(v);
  free(g);
  free(beta);
  free(out);
  free(out_fork);
  if (exit_code == 0) printf("kda-c-example: ok\n");
  return exit_code;
}
