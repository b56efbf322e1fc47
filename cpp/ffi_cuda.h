// Entry points of the CUDA part used by the nanobind glue (cuda_bind.cc).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "pool.h"

namespace ftjax {

void* expert_fill_handler(bool cmd_buffer);
void* expert_fill_units_handler(bool cmd_buffer);  // the unit split's partial fill (bf16 pools)
void* expert_fill_beside_handler();  // ... and the filled routes' compute, beside the GEMV (fill_beside.cu)
void prepare_fill_beside();  // its side stream and events (fill_beside.cu), before the first call with hits
void* cpu_submit_handler(bool cmd_buffer);
void* cpu_collect_handler(bool cmd_buffer);
void* cpu_publish_handler();          // the host plan's request (handshake.cu)
void* cpu_collect_checked_handler();  // ... and its collect, checked against the device plan
void* expert_fill_fork_handler();  // experimental: the fill on a side stream (bench/overlap.py)
void* stream_join_handler();       // ... and the join that makes XLA's stream wait for it
void sync_side_stream();           // the host waits for every forked fill issued so far
cudaStream_t side_stream();        // the side stream of the forked fills (made on first use)
void fork_to_side(cudaStream_t stream);  // the side stream waits for the work issued so far on `stream`

// Background fills batched per decode step (background.cu).
void* bg_wait_handler();
void* bg_fork_handler();
void* plan_cuda_handler();  // the fused plan of one MoE layer call (plan_cuda.cu)
void* route_tables_handler();  // the prefill route plan (route_tables_cuda.cu)
void* prefill_gate_up_handler();  // prefill gate+up with the row gather fused (prefill_gate_up_cuda.cu, sm_90a)
int64_t create_background(int64_t layers, int64_t max_fill);  // -> id
bool background_error(int64_t id);                            // a wait timed out
void clear_background_error(int64_t id);                      // (a fresh state: its waits have not)
void set_background_yield(int64_t id, int32_t mask);  // YieldMask bits (fill_device.cuh), read at each fork
int32_t background_yield(int64_t id);
int32_t transfer_word(int32_t word);                   // (tests) the transfer words' values, synchronously
void add_transfer_word(int32_t word, int32_t delta);  // (tests) a word held or released by hand
void destroy_background(int64_t id);  // after the GPU is idle; its id is unknown from then on
int64_t live_backgrounds();

// The transfer words (fill_device.cuh TransferWord): one pair per process (single GPU), made by the first
// call with `make` (a background's or a channel's creation, outside graph capture); nullptr before that.
int32_t* transfer_words(bool make);

// The fill kernels (also outside XLA: benchmarks, calibration). `words`: an in-step fill counts its
// blocks in the transfer words (nullptr: not counted).
void launch_fill(cudaStream_t stream, const ExpertPool& pool, const int32_t* ids, const int32_t* slots,
                 const int32_t* n_valid, int64_t capacity, int64_t n_slots, void* cache_gate_up, void* cache_down,
                 int64_t max_blocks = 0, int32_t* words = nullptr);

void launch_fill_units(cudaStream_t stream, const ExpertPool& pool, const int32_t* ids, const int32_t* slots,
                       const int32_t* n_valid, const int32_t* units, int64_t capacity, int64_t n_slots,
                       void* cache_gate_up, void* cache_down, int32_t* words = nullptr, int64_t max_blocks = 0);

// CPU-branch channels: staging in mapped pinned memory, served by one coordinator thread.
void create_channel(int64_t channel, uint64_t pool_id, int64_t max_tokens, int64_t max_tasks);
void destroy_channel(int64_t channel);  // after the GPU is idle: frees its staging
int64_t live_channels();
std::string channel_error(int64_t channel);  // last CPU-side error message ("" if none)
uint64_t channel_jobs(int64_t channel);      // jobs the coordinator completed on this channel
double channel_serve_seconds(int64_t channel);  // their CPU time, request seen -> done published

// Stamps of a channel's CPU-branch calls (handshake.cu): a ring of kStampRing rows each. The GPU's rows, per
// fused submit / collect (%globaltimer ns): the submit's seq (0: skipped), its start, its publication; the
// collect's seq, its start, when it saw done_seq, its end. The coordinator's rows, per request served
// (steady_clock ns): seq, seen, done published, whether it ran a job.
constexpr int64_t kStampRing = 2048;
enum StampField : int { kStSubmitSeq, kStSubmitStart, kStPublished, kStCollectSeq, kStCollectStart, kStDoneSeen,
                        kStCollectEnd, kStFields = 8 };
enum HostStampField : int { kHostSeq, kHostSeen, kHostDone, kHostJob, kHostStampFields };
struct StampCounts {
  uint64_t submits, collects, served;  // rows written so far (the ring keeps the last kStampRing)
};
// Copies both rings ([kStampRing, kStFields] and [kStampRing, kHostStampFields] int64) out; call while no step
// runs (after the host has waited for the step).
StampCounts channel_stamps(int64_t channel, int64_t* gpu, int64_t* host);

}  // namespace ftjax
