/* kda/kda_engine.h — the C API of kda-engine: an opaque engine handle over kda::engine::Engine.
 *
 * Plain C (C99) and C++. Link kda::engine (a C++ library: link the program with the C++ compiler,
 * or add the C++ runtime by hand). Every call maps onto the C++ Engine (kda/engine/engine.hpp);
 * what the engine does — one arena allocated at creation, state slots, prefill and decode on the
 * caller's pointers — is described there. docs/API.md (installed as share/kda/docs/API.md, section
 * "C") has a complete program and docs/MODEL.md the model description's schema;
 * share/kda/examples/c_example.c is a longer program, and share/kda/examples/models/ holds the
 * example model descriptions.
 *
 *   kda_engine_options options;
 *   kda_engine_options_init(&options);
 *   options.backend = KDA_BACKEND_CPU;
 *   kda_engine* engine = NULL;
 *   char err[512];
 *   if (kda_engine_create_from_file("model.yaml", &options, &engine, err, sizeof err) != KDA_OK) {
 *     fprintf(stderr, "%s\n", err);
 *   }
 *   int slot;
 *   kda_engine_acquire_slot(engine, &slot);
 *   kda_engine_prefill_hidden(engine, layer, hidden, out, &slot, 1, cu_seqlens);  (whole layers)
 *   kda_engine_prefill(engine, layer, q, k, v, g, beta, out, &slot, 1, cu_seqlens);  (KDA core)
 *   ...
 *   kda_engine_destroy(engine);
 *
 * Errors. Every function returns a kda_status (KDA_OK = 0). No C++ exception crosses this API and
 * nothing in it exits or aborts: a kda::Error becomes its status code, std::bad_alloc becomes
 * KDA_OUT_OF_MEMORY ("out of host memory"), anything else KDA_INTERNAL. A NULL handle or a NULL
 * pointer argument is KDA_INVALID_ARGUMENT, except where a call has nothing to read or write
 * there: the tensors of a whole-layer batch of 0 tokens and the arrays of 0 slot pairs or entries
 * may be NULL.
 *   - On a handle, the message of a failed call is kept per handle: kda_engine_last_error(engine)
 *     returns it until the next call on that handle (a successful call clears it to ""). It
 *     begins with the function's name ("kda_engine_prefill: prefill: sequence 0 uses slot 3,
 *     which is not an acquired slot"). Messages longer than 1023 bytes are truncated.
 *   - Creation has no handle yet: the create functions write the message into the caller's buffer
 *     `err` of `err_size` bytes (truncated to fit, always NUL-terminated when err_size > 0; "" on
 *     success). err may be NULL when err_size is 0.
 *
 * Threads. A handle is not thread-safe: use it from one thread at a time (different handles are
 * independent). The strings returned by kda_engine_last_error() and kda_status_string() need no
 * freeing; the former stays valid until the next call on the handle or its destruction.
 *
 * Pointers. Tensors passed to prefill/decode live on the engine's backend: host memory on the CPU
 * backend, device memory on CUDA (enqueued on options.cuda_stream; kda_engine_synchronize() waits).
 * Layouts, all bf16 (raw 16-bit values): q, k, g [T, H, K], v [T, H, V], beta [T, H], out
 * [T, H, V], with K = V = head_dim, T the tokens of the batch (decode: T = batch * tokens) and H
 * the engine's local heads, kda_engine_num_heads() / tp_size (the model's runtime.tp_size).
 * `slots` and `cu_seqlens` are host arrays, except in a kda_batch (below): caller-owned metadata
 * in the backend's memory.
 */
#ifndef KDA_KDA_ENGINE_H_
#define KDA_KDA_ENGINE_H_

#include <stddef.h>
#include <stdint.h>
#include <string.h> /* memset, in the two *_init functions below */

#ifdef __cplusplus
extern "C" {
#endif

/* Mirrors kda::StatusCode (kda/kda.hpp), value for value. */
typedef enum kda_status {
  KDA_OK = 0,
  KDA_INVALID_ARGUMENT = 1,    /* a shape, pointer, slot, index or value is wrong */
  KDA_UNSUPPORTED = 2,         /* valid, but not supported by this backend */
  KDA_OVERFLOW = 3,            /* a size whose element or byte count overflows 64 bits */
  KDA_WORKSPACE_TOO_SMALL = 4, /* a workspace smaller than needed */
  KDA_BACKEND_UNAVAILABLE = 5, /* CUDA not compiled in, or no device present */
  KDA_CUDA_ERROR = 6,          /* a CUDA runtime call or launch failed */
  KDA_INTERNAL = 7,            /* an invariant of the library broke: a bug */
  KDA_OUT_OF_MEMORY = 8,       /* host or device memory could not be allocated (the arena, a
                                  layer's weights, scratch): a smaller request may fit */
  /* Not a status: makes the enum an int-sized type whose range covers any int a caller passes. */
  KDA_STATUS_MAX_ENUM_ = 0x7FFFFFFF
} kda_status;

/* "ok", "invalid argument", ...; "unknown status" for a value outside the enum. */
const char* kda_status_string(kda_status status);

typedef enum kda_backend {
  KDA_BACKEND_DEFAULT = 0, /* the YAML's runtime.backend (itself auto by default) */
  KDA_BACKEND_AUTO = 1,    /* CUDA when a device is present and can run the model, else CPU */
  KDA_BACKEND_CPU = 2,
  KDA_BACKEND_CUDA = 3,
  KDA_BACKEND_MAX_ENUM_ = 0x7FFFFFFF /* not a backend (see KDA_STATUS_MAX_ENUM_) */
} kda_backend;

/* How the CUDA prefill schedules its phases (kda::PrefillSchedule, docs/KDA.md §3): DEFAULT is
 * the YAML's runtime.prefill_schedule (itself auto by default); AUTO picks per call from the
 * shape; TWO_PHASE and PIPELINED force one (for measurements). Same results to rounding. */
typedef enum kda_prefill_schedule {
  KDA_PREFILL_SCHEDULE_DEFAULT = 0,
  KDA_PREFILL_SCHEDULE_AUTO = 1,
  KDA_PREFILL_SCHEDULE_TWO_PHASE = 2,
  KDA_PREFILL_SCHEDULE_PIPELINED = 3,
  KDA_PREFILL_SCHEDULE_MAX_ENUM_ = 0x7FFFFFFF /* not a schedule (see KDA_STATUS_MAX_ENUM_) */
} kda_prefill_schedule;

/* How a CUDA whole layer runs a decode step (kda::layer::DecodeKernel, docs/LAYER.md): DEFAULT is
 * the YAML's runtime.decode_step (itself auto by default); AUTO runs a step of up to 8 sequences
 * (at most 32 (sequence, head) pairs) in one launch where it fits, the fused kernel for a step of
 * one token a row up to 128 (row, head) pairs (32 with an fp32 state, none with the full-rank
 * output gate) and the separate kernels otherwise (every step of several tokens a row); ONE_LAUNCH
 * is the one launch where it fits and AUTO's choice elsewhere; FUSED (the fused kernel, second
 * factors inside: kFusedFactors), FUSED_AFTER_GEMMS (kFused) and SEPARATE force one. Same results
 * to rounding. The one-launch step needs every multiprocessor at once: engines that run decode
 * steps on concurrent streams of one device should choose FUSED. */
typedef enum kda_decode_step {
  KDA_DECODE_STEP_DEFAULT = 0,
  KDA_DECODE_STEP_AUTO = 1,
  KDA_DECODE_STEP_ONE_LAUNCH = 2,
  KDA_DECODE_STEP_FUSED = 3,
  KDA_DECODE_STEP_FUSED_AFTER_GEMMS = 4,
  KDA_DECODE_STEP_SEPARATE = 5,
  KDA_DECODE_STEP_MAX_ENUM_ = 0x7FFFFFFF /* not a decode step (see KDA_STATUS_MAX_ENUM_) */
} kda_decode_step;

/* The recurrent states' dtype (the description's runtime.state_dtype, docs/MODEL.md): DEFAULT keeps
 * the description's (itself fp32 by default). */
typedef enum kda_state_dtype {
  KDA_STATE_DTYPE_DEFAULT = 0,
  KDA_STATE_DTYPE_FP32 = 1,
  KDA_STATE_DTYPE_BF16 = 2,
  KDA_STATE_DTYPE_MAX_ENUM_ = 0x7FFFFFFF /* not a dtype (see KDA_STATUS_MAX_ENUM_) */
} kda_state_dtype;

/* What each KDA layer of the engine runs (the description's runtime.layers, docs/MODEL.md): the
 * whole layer (hidden states in and out) or the KDA core alone; DEFAULT keeps the description's
 * (itself whole by default). */
typedef enum kda_layer_mode {
  KDA_LAYER_MODE_DEFAULT = 0,
  KDA_LAYER_MODE_WHOLE = 1,
  KDA_LAYER_MODE_CORE = 2,
  KDA_LAYER_MODE_MAX_ENUM_ = 0x7FFFFFFF /* not a layer mode (see KDA_STATUS_MAX_ENUM_) */
} kda_layer_mode;

/* The element type of an all-reduce (kda_communicator). */
typedef enum kda_collective_dtype {
  KDA_COLLECTIVE_F32 = 0,
  KDA_COLLECTIVE_BF16 = 1,
  KDA_COLLECTIVE_MAX_ENUM_ = 0x7FFFFFFF /* not a dtype (see KDA_STATUS_MAX_ENUM_) */
} kda_collective_dtype;

/* One rank's collectives over a group of engines, implemented by the caller (over NCCL, MPI, or
 * threads of one process): the C form of kda::engine::Communicator (docs/INTEGRATION.md,
 * "Transports"). Given at creation (kda_engine_options.communicator, .context_group);
 * the engine copies the struct, and `user` must stay valid until the engine is destroyed. A
 * callback returns 0 on success; any other value fails the engine call that made it
 * (KDA_INTERNAL, the message naming the function, the options field, the callback and the
 * value). Every rank of the group makes the same collectives in the same order, and a
 * collective's result holds every rank's part (on CUDA it may be enqueued on `stream` rather
 * than done when the callback returns). The engine never aborts a group, and a call refused on
 * one rank (its arguments checked before the first collective) is not known to the others, which
 * go on into that collective: a runtime whose call fails on any rank wakes or aborts the other
 * ranks through its own transport. The struct is matched by its exact size (48 bytes on LP64). */
typedef struct kda_communicator {
  size_t struct_size; /* sizeof(kda_communicator) */
  void* user;         /* handed to every callback */
  int rank;           /* this engine's rank, 0..size-1 */
  int size;           /* ranks in the group, >= 1 */
  kda_backend memory; /* where the collectives' buffers live: KDA_BACKEND_CPU (host memory) or
                         KDA_BACKEND_CUDA (device memory); the engine's backend's */
  int reserved;       /* must be 0 */
  /* data[i] = the sum over the ranks of their data[i], in place, `count` elements of `dtype`;
   * every rank must get the same bits (bf16: e.g. sum in fp32 in rank order and round once, as
   * the engine's in-process transports do). `stream` is the engine's cudaStream_t (NULL on the
   * CPU): the work may be enqueued on it, behind what is already there. */
  int (*all_reduce_sum)(void* user, void* data, size_t count, kda_collective_dtype dtype,
                        void* stream);
  /* recv[r * bytes .. (r + 1) * bytes) = rank r's send, for every rank r. */
  int (*all_gather)(void* user, const void* send, void* recv, size_t bytes, void* stream);
} kda_communicator;

/* Creation options. Always start from kda_engine_options_init(): it sets struct_size, which
 * creation checks (so a struct from a different version of this header is refused, not misread). */
typedef struct kda_engine_options {
  size_t struct_size;  /* sizeof(kda_engine_options), set by kda_engine_options_init */
  kda_backend backend; /* default KDA_BACKEND_DEFAULT */
  void* cuda_stream;   /* cudaStream_t for everything the engine enqueues; NULL: default stream */
  int cpu_threads;     /* CPU backend threads, at most; 0 (default): the hardware's. A call uses
                          no more than its work pays for, and at most 64 */
  uint64_t seed;       /* random layer parameters when the YAML names no weights; default 0 */
  int check_pointers;  /* CUDA: check on every call that the caller's pointers are device memory
                          of the current device and large enough; default 1, 0 skips the driver
                          queries (host time) */
  kda_prefill_schedule prefill_schedule; /* CUDA prefill; default KDA_PREFILL_SCHEDULE_DEFAULT */
  kda_decode_step decode_step;           /* CUDA whole layers' decode steps; default
                                            KDA_DECODE_STEP_DEFAULT (0) */
  int null_slot; /* a slot index that is padding in every batch, as a negative one, and is never
                    acquired (kda::engine::EngineOptions::null_slot: one of the max_sequences
                    slots); default -1, as any negative value: none */
  int reserved2; /* must be 0; with null_slot, kept the size of the version that added it (64 bytes
                    on LP64) apart from the one before (56) */
  /* Values that replace the description's runtime keys, each checked as the description's own
   * (kda::engine::RuntimeOverrides; an error names the key and says it was overridden): */
  int64_t max_tokens;          /* > 0: runtime.max_tokens; 0 (default): the description's */
  int64_t max_sequences;       /* > 0: runtime.max_sequences (the state slots); 0 (default): the
                                  description's */
  kda_state_dtype state_dtype; /* runtime.state_dtype; default KDA_STATE_DTYPE_DEFAULT */
  int reserved3;               /* must be 0 (88 bytes on LP64) */
  kda_layer_mode layer_mode;   /* runtime.layers; default KDA_LAYER_MODE_DEFAULT */
  int poison_arena;            /* 1: fill the arena with 0xFF bytes (NaN in bf16 and f32) once it
                                  is allocated, before weights and states are written, and each
                                  layer's workspace before every call that runs the layer, so that
                                  a read of memory nothing wrote shows as NaN (a debugging aid,
                                  kda::engine::EngineOptions::poison_arena); default 0 */
  /* Tensor parallelism (runtime.tp_size > 1, whole layers): this rank's group, of tp_size ranks
   * with rank tp_rank. With it every whole-layer call all-reduces its output over the ranks
   * (bf16), so that each rank returns the whole layer's output; NULL (default): `out` is this
   * rank's partial sum, which the runtime all-reduces. */
  const kda_communicator* communicator;
  /* Context parallelism (tp_size 1, an fp32 state): the group whose ranks share long prefills
   * (kda_engine_prefill_context_parallel, kda_engine_prefill_hidden_context_parallel); NULL
   * (default): none. (112 bytes on LP64.) */
  const kda_communicator* context_group;
} kda_engine_options;

/* Fills *options with the defaults. KDA_INVALID_ARGUMENT when options is NULL. Defined in this
 * header, so that it runs in the caller's code with the caller's sizeof(kda_engine_options): a
 * library of another version then refuses the struct at creation, where a function of the library
 * would have written its own version's size into the caller's smaller struct. */
static inline kda_status kda_engine_options_init(kda_engine_options* options) {
  if (options == NULL) return KDA_INVALID_ARGUMENT;
  memset(options, 0, sizeof *options); /* every enum's DEFAULT is 0, every pointer NULL */
  options->struct_size = sizeof *options;
  options->check_pointers = 1;
  options->null_slot = -1;
  return KDA_OK;
}

typedef struct kda_engine kda_engine; /* opaque */

/* Reads a YAML model description (share/kda/docs/MODEL.md) and creates an engine: loads
 * parameters, plans memory and allocates the one arena. `options` may be NULL (defaults). On
 * success *out_engine is the new handle; on failure it is NULL and `err` holds the message. */
kda_status kda_engine_create_from_file(const char* yaml_path, const kda_engine_options* options,
                                       kda_engine** out_engine, char* err, size_t err_size);
/* The same from YAML text. Messages name the source "<yaml string>"; a relative `weights` path is
 * used as written (relative to the current directory). */
kda_status kda_engine_create_from_string(const char* yaml_text, const kda_engine_options* options,
                                         kda_engine** out_engine, char* err, size_t err_size);
/* What kda_engine_create_from_file / _from_string would allocate, with the same description and
 * options, without making the engine: nothing is allocated and no weights are read (a `weights`
 * path is checked to exist). *arena_bytes gets the one allocation's size and *backend (may be
 * NULL) the backend creation would take on this machine (options.backend resolved as creation
 * resolves it). For sizing max_sequences or max_tokens (options.max_sequences, .max_tokens) to the
 * memory at hand before committing to it. On failure `err` holds the message, as for creation. */
kda_status kda_engine_plan_from_file(const char* yaml_path, const kda_engine_options* options,
                                     uint64_t* arena_bytes, kda_backend* backend, char* err,
                                     size_t err_size);
kda_status kda_engine_plan_from_string(const char* yaml_text, const kda_engine_options* options,
                                       uint64_t* arena_bytes, kda_backend* backend, char* err,
                                       size_t err_size);
/* Waits for the engine's work (CUDA) and frees everything. NULL is a no-op (KDA_OK). */
kda_status kda_engine_destroy(kda_engine* engine);

/* The message of the last call on `engine` when it failed, "" when it succeeded. Never NULL; for a
 * NULL handle, a fixed message saying so. */
const char* kda_engine_last_error(const kda_engine* engine);

/* ---- queries (each writes *out only on success) ------------------------------------------- */
kda_status kda_engine_num_layers(kda_engine* engine, int* out);      /* KDA layers */
kda_status kda_engine_num_heads(kda_engine* engine, int64_t* out);   /* every rank's heads */
kda_status kda_engine_head_dim(kda_engine* engine, int64_t* out);    /* K = V */
kda_status kda_engine_backend(kda_engine* engine, kda_backend* out); /* KDA_BACKEND_CPU or _CUDA */
kda_status kda_engine_max_tokens(kda_engine* engine, int64_t* out);  /* tokens per prefill */
kda_status kda_engine_max_sequences(kda_engine* engine, int64_t* out); /* = state slots */
kda_status kda_engine_free_slots(kda_engine* engine, int* out);
/* The size of the one allocation (Engine::arena_bytes(), "arena_bytes" in the plan JSON). */
kda_status kda_engine_arena_bytes(kda_engine* engine, uint64_t* out);
/* What the engine was made with, for a runtime that routes its decoder layers to the engine and
 * sizes its batches without reading the model description itself: */
/* The 1-based model layer (the description's kda_layers entry) of KDA layer `layer` (0-based):
 * which decoder layers run through the engine. KDA_INVALID_ARGUMENT for `layer` outside
 * 0..num_layers-1. */
kda_status kda_engine_model_layer(kda_engine* engine, int layer, int* out);
kda_status kda_engine_conv_width(kda_engine* engine, int* out); /* W, the short conv's width */
/* The recurrent states' dtype: KDA_STATE_DTYPE_FP32 or _BF16 (runtime.state_dtype, after
 * options.state_dtype). */
kda_status kda_engine_state_dtype(kda_engine* engine, kda_state_dtype* out);
/* This engine's tensor-parallel rank and the ranks (runtime.tp_rank, tp_size); with size > 1 the
 * whole-layer calls' out is a partial sum the runtime all-reduces over the ranks. Either pointer
 * may be NULL, not both. */
kda_status kda_engine_tensor_parallel(kda_engine* engine, int* rank, int* size);
/* runtime.max_verify_tokens (0: no record-and-commit verify steps) and runtime.record_regions. */
kda_status kda_engine_max_verify_tokens(kda_engine* engine, int* out);
kda_status kda_engine_record_regions(kda_engine* engine, int* out);
/* The null slot in effect (options.null_slot; -1: none). */
kda_status kda_engine_null_slot(kda_engine* engine, int* out);
/* *out = 1 when `slot` is acquired, 0 when free (the null slot: 0). KDA_INVALID_ARGUMENT for a
 * slot outside 0..max_sequences-1. */
kda_status kda_engine_slot_in_use(kda_engine* engine, int slot, int* out);
/* The memory plan as JSON ({"mode", "alignment", "arena_bytes", "buffers": [...]}), snprintf-like:
 * *length (may be NULL) receives the JSON's length without the terminating NUL, always. With
 * buffer == NULL and buffer_size == 0 it only reports the length (KDA_OK). Otherwise the buffer
 * needs length + 1 bytes: when it has them the JSON is copied (NUL-terminated) and KDA_OK returned;
 * when not, buffer[0] is set to '\0' where buffer_size > 0 (no half JSON; nothing is written to a
 * buffer of 0 bytes) and KDA_INVALID_ARGUMENT returned with a message giving the size needed. */
kda_status kda_engine_plan_json(kda_engine* engine, char* buffer, size_t buffer_size,
                                size_t* length);

/* ---- state slots ---------------------------------------------------------------------------- */
/* The lowest free slot (never options.null_slot), its state zeroed in every layer;
 * KDA_INVALID_ARGUMENT when all are in use. */
kda_status kda_engine_acquire_slot(kda_engine* engine, int* out_slot);
kda_status kda_engine_release_slot(kda_engine* engine, int slot);
/* Zeroes the slot's state in every layer; the slot stays acquired. acquire and reset stage the slot
 * index from pageable host memory, then zero it in one launch: eager calls, not for a stream
 * capture (kda_engine_reset_slots zeroes slots a device array names inside a captured graph). */
kda_status kda_engine_reset_slot(kda_engine* engine, int slot);
/* A sequence's whole state as one host block (kda::engine::Engine::read_sequence_state): a
 * 64-byte header (kda::engine::SequenceStateHeader, the host's byte order: char[8] "KDASTATE",
 * uint32 version 1, uint32 header bytes 64, uint64 payload bytes, then uint32 KDA layers, heads,
 * head_dim, conv width (0: no conv states), state value bytes (4 fp32, 2 bf16), tensor-parallel
 * rank and size, and three words written zero and not read), then per KDA layer, in order, the
 * recurrent state [local heads, V, K] of the state dtype (local heads = heads / tensor-parallel
 * size) and with whole layers the q, k and v conv states
 * (bf16 [local heads * head_dim, W - 1]). For moving a sequence to host memory and back, or
 * between engines of one model, state dtype and tensor-parallel rank: a write refuses a block
 * whose header differs (KDA_INVALID_ARGUMENT, each field named, the header checked before the
 * size) before it copies anything. Synchronous. `bytes` must equal
 * kda_engine_sequence_state_bytes(); the write's slot must be acquired (or be the null slot). */
kda_status kda_engine_sequence_state_bytes(kda_engine* engine, uint64_t* out);
kda_status kda_engine_read_sequence_state(kda_engine* engine, int slot, void* host_dst,
                                          uint64_t bytes);
kda_status kda_engine_write_sequence_state(kda_engine* engine, int slot, const void* host_src,
                                           uint64_t bytes);
/* Copies slot src's states into slot dst in every layer (recurrent states, and conv states with
 * whole layers): a request that starts from a cached prefix's checkpoint slot without consuming
 * it, or a forked sequence. Both acquired and different; checked on the host, then enqueued
 * (asynchronous on CUDA; not for capture: kda_engine_copy_slots is). */
kda_status kda_engine_copy_slot(kda_engine* engine, int src, int dst);
/* The same for `pairs` pairs (0..max_sequences) in the backend's memory (device memory on CUDA,
 * as kda_batch's arrays): src[i] into dst[i], int32 each; a pair with a negative entry or the null
 * slot is padding. The destinations are distinct acquired slots, none also a source (one source
 * may go to several destinations). CPU: KDA_INVALID_ARGUMENT before anything is written when not;
 * CUDA: read on the device only (nothing staged or synchronized: capturable, replayed with new
 * pairs), an entry outside the pool reported by kda_engine_check_device_status() and its pair
 * skipped, the rest the caller's promise (kda::engine::Engine::copy_slots). */
kda_status kda_engine_copy_slots(kda_engine* engine, int64_t pairs, const int32_t* src,
                                 const int32_t* dst);
/* Zeroes `count` slots (0..max_sequences) in every layer, as kda_engine_reset_slot does one:
 * slots int32 [count] in the backend's memory, a negative entry or the null slot padding, an entry
 * may repeat. CPU: KDA_INVALID_ARGUMENT before anything is written for an entry that is not an
 * acquired slot; CUDA: read on the device only (capturable), an entry outside the pool reported
 * by kda_engine_check_device_status() (kda::engine::Engine::reset_slots). */
kda_status kda_engine_reset_slots(kda_engine* engine, int64_t count, const int32_t* slots);

/* ---- forward -------------------------------------------------------------------------------- */
/* Prefill of KDA layer `layer` (0-based among the KDA layers; run them in order) for
 * `num_sequences` sequences: sequence j has tokens cu_seqlens[j] .. cu_seqlens[j+1] and uses
 * slots[j], starting from that slot's state and leaving its final state there. cu_seqlens has
 * num_sequences + 1 entries: 0, non-decreasing, the last (T) at most max_tokens; 1..max_sequences
 * sequences on distinct acquired slots, or a negative slot (or the null slot): a padding sequence,
 * run from a zero state, its out written and no state read or written. Asynchronous on CUDA. */
kda_status kda_engine_prefill(kda_engine* engine, int layer, const void* q, const void* k,
                              const void* v, const void* g, const void* beta, void* out,
                              const int* slots, int num_sequences, const int64_t* cu_seqlens);
/* Decode of KDA layer `layer`: `tokens` (1..16) new tokens for each of `batch` (1..max_sequences)
 * rows, inputs [batch, tokens, ...], out [batch, tokens, H, V]. slots[b] < 0 marks a padding row
 * (skipped, its out untouched); the others are distinct acquired slots, updated in place.
 * Asynchronous on CUDA. */
kda_status kda_engine_decode(kda_engine* engine, int layer, const void* q, const void* k,
                             const void* v, const void* g, const void* beta, void* out,
                             const int* slots, int batch, int tokens);
/* ---- whole layers ---------------------------------------------------------------------------
 * By default (YAML runtime.layers: whole) each KDA layer is the whole Kimi Delta Attention layer:
 * hidden states in, hidden states out (projections, short convolutions, the KDA core, gated
 * RMSNorm, output projection), bf16 [T, hidden_size] both, on the engine's backend. A slot then
 * holds the sequence's whole state in every layer (conv states and recurrent state), zeroed by
 * acquire / reset. With runtime.tp_size > 1, `out` is this rank's PARTIAL SUM of the layer output:
 * the host runtime all-reduces it over the ranks, unless the engine was given a communicator
 * (kda_engine_options.communicator), which does so inside each call. kda_engine_prefill /
 * kda_engine_decode still run the KDA core alone on the same recurrent states. */
kda_status kda_engine_hidden_size(kda_engine* engine, int64_t* out);
/* *out = 1 when the engine runs whole layers, 0 when KDA cores only (runtime.layers: core). */
kda_status kda_engine_whole_layers(kda_engine* engine, int* out);
/* *out = the kernel the last decode step of CUDA whole layer `layer` ran: ONE_LAUNCH, FUSED,
 * FUSED_AFTER_GEMMS or SEPARATE (kda::engine::Engine::decode_step_ran); AUTO where it has run
 * none (none yet, the CPU, core-only engines). A captured step records it when captured. */
kda_status kda_engine_decode_step_ran(kda_engine* engine, int layer, kda_decode_step* out);
/* Prefill of whole layer `layer` on hidden states [T, hidden_size] (T = cu_seqlens[num_sequences]);
 * slots and cu_seqlens as kda_engine_prefill. KDA_INVALID_ARGUMENT on a core-only engine. */
kda_status kda_engine_prefill_hidden(kda_engine* engine, int layer, const void* hidden, void* out,
                                     const int* slots, int num_sequences,
                                     const int64_t* cu_seqlens);
/* Decode of whole layer `layer`: `tokens` (1..16) new tokens for each of `batch` rows, hidden and
 * out [batch * tokens, hidden_size]. slots[b] < 0 marks a padding row (its out zeros, no state
 * touched). */
kda_status kda_engine_decode_hidden(kda_engine* engine, int layer, const void* hidden, void* out,
                                    const int* slots, int batch, int tokens);

/* ---- context parallelism (kda_engine_options.context_group) ----------------------------------
 * The prefill of one long sequence split over the group's ranks, each holding `tokens` consecutive
 * tokens of it (rank r the r-th range; 0 tokens allowed, then the tensors may be NULL), every rank
 * with the sequence's initial state in its acquired `slot` (the same state on each: zeros for a
 * new sequence). out is the one-engine prefill's to rounding, and afterwards every rank's `slot`
 * holds the sequence's final state (kda::engine::Engine::prefill_context_parallel). Every rank
 * calls it for the same layer; where it fails on one rank the others wait in a collective
 * (kda_communicator says what the runtime does then). */
/* The KDA core: q, k, v, g [tokens, H, K], beta [tokens, H], out [tokens, H, V], as
 * kda_engine_prefill. */
kda_status kda_engine_prefill_context_parallel(kda_engine* engine, int layer, const void* q,
                                               const void* k, const void* v, const void* g,
                                               const void* beta, void* out, int slot,
                                               int64_t tokens);
/* Whole layers (tp_size 1): hidden and out bf16 [tokens, hidden_size], as
 * kda_engine_prefill_hidden. On CUDA the host reads the gathered conv histories: the call waits
 * for the work before it, once. */
kda_status kda_engine_prefill_hidden_context_parallel(kda_engine* engine, int layer,
                                                      const void* hidden, void* out, int slot,
                                                      int64_t tokens);

/* ---- batch metadata owned by the caller (CUDA graphs) ----------------------------------------
 * The forwards above on metadata the caller keeps in the engine's backend memory (device memory on
 * CUDA, host memory on the CPU) and rewrites before each call, or before each replay of calls
 * captured in a CUDA graph: nothing is staged or synchronized. Only tokens, sequences and
 * decode_tokens (the bounds) and the scalars checkpoints, records, records_region and fold_region
 * are host values, fixed when a call is made or captured. On CUDA, a
 * slot outside the pool or broken cu_seqlens set the device status word
 * (kda_engine_check_device_status): a slot outside the pool makes its row a padding row, and
 * after broken cu_seqlens the batch's outputs and states are unspecified (every access stays in
 * bounds); that slots are acquired
 * and distinct is the caller's promise there. On the CPU the same is checked before anything runs.
 * (C++: kda::engine::BatchMetadata.) */
typedef struct kda_batch {
  size_t struct_size;        /* sizeof(kda_batch) of the header the caller was built with, set by
                                kda_batch_init(): a library reads the fields that size holds and
                                takes fields added after them as unset */
  int64_t tokens;            /* rows of hidden / of q..beta: the sum of the sequence lengths, or
                                sequences * decode_tokens */
  int64_t sequences;         /* prefill sequences or decode rows, 1..max_sequences */
  int decode_tokens;         /* 0: prefill; 1..16: a decode step of that many tokens per row */
  const int32_t* slots;      /* [sequences]; negative, or options.null_slot: a padding row (no
                                state read or written; whole layers output zeros for it) */
  const int64_t* cu_seqlens; /* prefill: [sequences + 1], 0, non-decreasing, last == tokens
                                (or int32 in cu_seqlens_i32, below) */
  /* Decode only, optional (NULL: none): a speculative verify step, [sequences] each in
     1..decode_tokens, and `slots` then [sequences, decode_tokens]: row r starts from the states in
     slots[r][num_accepted[r] - 1] and keeps its states after token t in slots[r][t] (negative:
     not kept); a row whose start entry is negative is padding (kda::engine::BatchMetadata). */
  const int32_t* num_accepted;
  /* Prefill only, optional (0 / NULL: none): prefix-cache checkpoints, `checkpoints` requests per
     sequence, checkpoint_offsets [sequences, checkpoints] (tokens; -1: none) and checkpoint_slots
     [sequences, checkpoints] (acquired slots; -1: none), as kda::engine::BatchMetadata (CUDA:
     checked on the device, reported by kda_engine_check_device_status). */
  int64_t checkpoints;
  const int64_t* checkpoint_offsets;
  const int32_t* checkpoint_slots;
  /* Prefill, instead of cu_seqlens (NULL: not used): the same offsets as int32 (vLLM's and
     SGLang's query_start_loc), read as they are. A prefill sets exactly one of cu_seqlens and
     cu_seqlens_i32 (KDA_INVALID_ARGUMENT otherwise). */
  const int32_t* cu_seqlens_i32;
  /* Decode only, optional (0: no): nonzero makes the step the record-and-commit form of a verify
     step (kda::engine::BatchMetadata::records), with num_accepted NULL and `slots` [sequences],
     each row's committed slot: no state is written, each layer keeps the step's records (the
     model's runtime.max_verify_tokens >= decode_tokens, KDA_INVALID_ARGUMENT otherwise) until
     kda_engine_commit() folds the accepted tokens in. */
  int records;
  int reserved; /* must be 0 */
  /* Decode only, with the model's runtime.record_regions 2: the records region (0 or 1) a records
     step writes; alternate it from one records step to the next when folding (below). */
  int records_region;
  /* Decode only, optional (NULL: none): the commit of the last records step that wrote records
     region `fold_region` deferred into this step instead of kda_engine_commit()
     (kda::engine::BatchMetadata::fold_rows): fold_rows and fold_counts [sequences] each; row r
     starts from its slot after folding in the first fold_counts[r] tokens of that records step's
     row fold_rows[r] (negative: none). Not with num_accepted; a records step that folds writes the
     other region. */
  int fold_region;
  const int32_t* fold_rows;
  const int32_t* fold_counts;
} kda_batch;
/* Sets every field of *batch to 0 / NULL (every optional field unset) and struct_size to
 * sizeof(kda_batch) as the caller's header has it (defined here, as kda_engine_options_init is).
 * Start every kda_batch from it: the calls refuse a struct_size they cannot read
 * (KDA_INVALID_ARGUMENT). KDA_INVALID_ARGUMENT when batch is NULL. */
static inline kda_status kda_batch_init(kda_batch* batch) {
  if (batch == NULL) return KDA_INVALID_ARGUMENT;
  memset(batch, 0, sizeof *batch);
  batch->struct_size = sizeof *batch;
  return KDA_OK;
}
/* The KDA core of layer `layer` (prefill or decode by batch->decode_tokens). */
kda_status kda_engine_forward_batch(kda_engine* engine, int layer, const void* q, const void* k,
                                    const void* v, const void* g, const void* beta, void* out,
                                    const kda_batch* batch);
/* The whole layer `layer` on hidden states (prefill or decode by batch->decode_tokens). */
kda_status kda_engine_forward_hidden_batch(kda_engine* engine, int layer, const void* hidden,
                                           void* out, const kda_batch* batch);

/* The commit of a record-and-commit verify step (kda_batch::records; kda::engine::Engine::commit):
 * folds the first num_accepted[r] tokens of each row r of the last records step into slots[r] of
 * every KDA layer, in one operator commit launch and one conv launch on CUDA (nothing staged or
 * synchronized: capturable). slots and num_accepted: int32 [sequences] in the backend's memory,
 * the records step's slots and each count in 1..decode_tokens. KDA_INVALID_ARGUMENT (message:
 * kda_engine_last_error) without runtime.max_verify_tokens, when some KDA layer ran no records step
 * on this region or its last one was not of `sequences` rows (every layer's of the same tokens), or
 * (CPU) for a count out of range or a slot not acquired; on CUDA a bad count or slot is reported by
 * kda_engine_check_device_status(). The host checks only that shape and a commit does not consume
 * the records (a graph of records steps may be replayed before each eager commit): committing the
 * same records twice folds them in twice; calling it once per records step is the caller's part
 * (docs/API.md, the record-and-commit order). */
kda_status kda_engine_commit(kda_engine* engine, int64_t sequences, const int32_t* slots,
                             const int32_t* num_accepted);
/* The same for the records step that wrote records region `records_region` (0 or 1, below the
 * model's runtime.record_regions; kda_batch::records_region). */
kda_status kda_engine_commit_region(kda_engine* engine, int64_t sequences, const int32_t* slots,
                                    const int32_t* num_accepted, int records_region);

/* Waits for everything the engine enqueued (CUDA); a no-op on the CPU. */
kda_status kda_engine_synchronize(kda_engine* engine);
/* What the kernels found that the host could not see, over every call since the last check: gate
 * parameters out of range, broken device-side cu_seqlens (KDA_INVALID_ARGUMENT, the message names
 * them; the word is then cleared). Synchronizes the engine's stream: call it where you would wait
 * for results anyway, not per layer. KDA_OK, and a no-op, on the CPU backend. */
kda_status kda_engine_check_device_status(kda_engine* engine);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KDA_KDA_ENGINE_H_ */
