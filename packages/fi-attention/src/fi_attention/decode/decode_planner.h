// Split-KV planner of batch decode in host C++: plan() of a non-uniform batch, and of every host
// page table from a wrapper's second plan on (fi_plan_decode_staged, which also checks and stages
// the table). Chunk plans (the search) and, on kernels that run piece chains, plans of balanced
// pieces (build_pieces).
//
// It makes the same plans as fi_attention.decode.planner.plan_decode, bit for bit
// (tests/decode/test_planner.py runs both on thousands of random batches). That module is the
// specification and documents the cost model; this file is its chunk search and work-item layout
// without numpy's per-call costs (~25 ufunc calls and a Python loop over ~40 candidates: ~29 us
// per plan on this project's 2-core VM, against ~1.5 us here for batch 16 or 128). The model's
// constants come from Python in DecodePlanConfig, so they are defined once.
//
// Every decode module exports it (decode_common.cuh includes this file): the wrapper calls it
// through the module it launches, which plan() has loaded anyway. It also builds on its own with
// the system C++ compiler (``c++ -O3 -x c++ -shared -fPIC decode_planner.h``), which is how the
// CPU tests and the host-path simulator (hostsim.py) get it.
#pragma once
#include <math.h>
#include <stdint.h>

#ifndef FI_EXPORT
#define FI_EXPORT extern "C" __attribute__((visibility("default")))
#endif

// Mirrored by fi_attention.decode.planner.PlanConfig (ctypes); every field is 8 bytes wide. The
// model's constants, then what is fixed for a wrapper's kernel: CTAs per work item, the GPU's SMs
// and resident CTAs per SM, the items the search may add over one per request, the page size; then
// the piece plans' constants (planner.plan_pieces) and whether the kernel runs piece chains.
struct DecodePlanConfig {
  double one_cta_rate, multi_cta_rate, cta_cost, merge_cost, wave_tail, wave_cta_cost, wave_merge_cost;
  int64_t min_chunk, chunk_align, max_waves, max_pieces;
  int64_t kv_units, sm_count, ctas_per_sm, limit_extra, page_size;
  int64_t min_piece, piece_cost, piece_gain_pct, pieces;
};

// info[] written by fi_plan_decode.
enum { FI_PLAN_CHUNK = 0, FI_PLAN_ITEMS = 1, FI_PLAN_SLOTS = 2, FI_PLAN_LONGEST = 3 };

namespace fi_decode_plan {

constexpr int kMaxCandidates = 64;      // per candidate list (planner.plan_config checks the sizes)
constexpr int64_t kMaxPieceGroups = 1024;  // planner.MAX_PIECE_GROUPS
constexpr int64_t kHistBuckets = 4096;  // the histogram count serves requests up to 4096 * align tokens

// Token counts of a checked page table (tables.request_lengths has validated it).
struct Lengths {
  const int32_t* indptr;
  const int32_t* last;
  int64_t page_size;
  int64_t operator[](int64_t b) const {
    const int64_t pages = (int64_t)indptr[b + 1] - indptr[b];
    return pages > 0 ? (pages - 1) * page_size + last[b] : 0;
  }
};

// planner._model_time for one candidate chunk with n items.
inline double model_time(const DecodePlanConfig& m, int64_t n, double chunk, int64_t total, int64_t longest) {
  const int64_t sms = m.sm_count, units = m.kv_units;
  const int64_t slots = sms * m.ctas_per_sm > 1 ? sms * m.ctas_per_sm : 1;
  const int64_t ctas = n * units;
  double t;
  if (ctas <= slots) {  // one wave
    const int64_t per_sm = (ctas + sms - 1) / sms;
    t = (double)per_sm * chunk * (per_sm <= 1 ? 1.0 / m.one_cta_rate : 1.0 / m.multi_cta_rate);
    const double one_floor = (double)(total * units) / (double)sms;
    if (t < one_floor) t = one_floor;
    t += (double)per_sm * m.cta_cost;
    if (chunk < (double)longest) t += m.merge_cost;
  } else {  // several waves, as greedy list scheduling (see planner.WAVE_TAIL)
    double tail = (double)((ctas + slots - 1) / slots) - (double)ctas / (double)slots;
    if (tail > m.wave_tail) tail = m.wave_tail;
    t = (double)(total * units) / (double)slots + tail * chunk + (double)ctas * (m.wave_cta_cost / (double)slots);
    if (chunk < (double)longest) t += m.wave_merge_cost;
    t = t * ((double)slots / (double)sms) + (double)m.ctas_per_sm * m.cta_cost;
  }
  return t;
}

// planner._choose_chunk: the candidate with the smallest modelled time (ties: the larger), or
// ``longest`` when nothing else fits the item limit.
inline int64_t choose_chunk(const DecodePlanConfig& m, const Lengths& lens, int64_t batch, int64_t longest,
                            int64_t total, int64_t limit) {
  if (batch > limit) return longest;
  // Candidates: the longest request in k = 1..max_pieces equal pieces, then the whole batch in j
  // CTAs on every SM for j in {1, 2} and the whole waves. Each list falls as its divisor grows, so
  // both are written backwards (ascending) and merged.
  const int64_t align = m.chunk_align;
  auto chunk_of = [&](int64_t x, int64_t d) {
    int64_t c = ((x - 1) / (d * align) + 1) * align;
    if (c < m.min_chunk) c = m.min_chunk;
    return c > longest ? longest : c;
  };
  int64_t pieces[kMaxCandidates], whole[kMaxCandidates];
  const int np = (int)(m.max_pieces < kMaxCandidates ? m.max_pieces : kMaxCandidates);
  for (int k = np; k >= 1; --k) pieces[np - k] = chunk_of(longest, k);
  const int64_t cps = m.ctas_per_sm > 1 ? m.ctas_per_sm : 1;
  const double per_unit = (double)m.sm_count / (double)(m.kv_units > 1 ? m.kv_units : 1);
  int64_t js[kMaxCandidates] = {1, 2};  // {1, 2} and cps * w for w = 1..max_waves: ascending, distinct
  int nj = 2;
  for (int64_t w = 1; w <= m.max_waves && nj < kMaxCandidates; ++w)
    if (cps * w > js[nj - 1]) js[nj++] = cps * w;
  for (int i = 0; i < nj; ++i) {
    const int64_t d = (int64_t)floor((double)js[nj - 1 - i] * per_unit);
    whole[i] = chunk_of(total, d > 1 ? d : 1);
  }
  int64_t cand[2 * kMaxCandidates];
  int nd = 0;
  for (int a = 0, b = 0; a < np || b < nj;)
    cand[nd++] = (b >= nj || (a < np && pieces[a] <= whole[b])) ? pieces[a++] : whole[b++];
  // Candidates below total / limit tokens make more items than the limit, whatever the lengths.
  int lo = 0;
  if (total > m.min_chunk * limit) {
    const int64_t least = (total + limit - 1) / limit;
    while (lo < nd && cand[lo] < least) ++lo;
  }
  // Item counts, two ways: ceil(len / c) per request and candidate, or, when cheaper, a histogram
  // of the lengths in chunk_align-token units (every candidate but ``longest``, whose count is
  // ``batch``, is a multiple of it), whose suffix sums give #{len > k c}: the items of c are those
  // counts summed over k (a request is counted once per k with k c < len: ceil(len / c) times).
  const int64_t units = (longest + align - 1) / align;  // histogram buckets
  int64_t direct_cost = 0, hist_cost = batch + 2 * units;
  for (int i = lo; i < nd; ++i)
    if (cand[i] < longest && (i == lo || cand[i] != cand[i - 1])) {
      direct_cost += batch;
      hist_cost += (longest + cand[i] - 1) / cand[i];
    }
  int32_t above[kHistBuckets + 1];  // above[t] = #{requests with len > t * align}
  const bool hist = m.min_chunk % align == 0 && units <= kHistBuckets && hist_cost < direct_cost;
  if (hist) {
    for (int64_t t = 0; t < units; ++t) above[t] = 0;
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t len = lens[b] > 0 ? lens[b] : 1;
      ++above[(len + align - 1) / align - 1];  // len > t * align for t < ceil(len / align)
    }
    for (int64_t t = units - 1; t > 0; --t) above[t - 1] += above[t];
  }
  // The counts do not increase along the sorted candidates: those over the limit come first.
  int64_t best = longest, prev = -1;
  double best_t = 0.0, prev_t = 0.0;
  bool any = false;
  for (int i = lo; i < nd; ++i) {
    const int64_t c = cand[i];
    double t = prev_t;
    if (c != prev) {
      int64_t items = 0;
      if (c >= longest) {
        items = batch;
      } else if (hist) {
        const int64_t step = c / align;
        for (int64_t x = 0; x < units; x += step) items += above[x];
      } else {
        const double inv = 1.0 / (double)c;
        for (int64_t b = 0; b < batch; ++b) {
          const int64_t x = (lens[b] > 0 ? lens[b] : 1) - 1;  // ceil(len / c) = x / c + 1
          int64_t q = (int64_t)((double)x * inv);
          const int64_t r = x - q * c;  // the product may round across an integer: correct by one
          q += (r >= c) - (r < 0);
          items += q + 1;
        }
      }
      if (items > limit) continue;
      t = model_time(m, items, (double)c, total, longest);
      prev = c;
      prev_t = t;
    }
    if (!any || t <= best_t) {  // <=: the last (largest) of the cheapest
      best = c;
      best_t = t;
      any = true;
    }
  }
  return best;
}

// planner._wave_items: work items (of kv_units CTAs) in one wave.
inline int64_t wave_items(const DecodePlanConfig& m) {
  const int64_t w = m.sm_count * m.ctas_per_sm / (m.kv_units > 1 ? m.kv_units : 1);
  return w > 1 ? w : 1;
}

// planner._chunk_load: the chunk plan's items in order, each onto the least loaded of ``groups``
// groups (a binary min-heap: heapq.heapreplace's pop and push), in tokens; the largest load.
inline int64_t chunk_load(const Lengths& lens, int64_t batch, int64_t chunk, int64_t groups) {
  int64_t heap[kMaxPieceGroups];
  for (int64_t i = 0; i < groups; ++i) heap[i] = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t n = lens[b];
    const int64_t k = chunk && n > 0 ? (n - 1) / chunk + 1 : 1;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t t = chunk ? (n - j * chunk < chunk ? n - j * chunk : chunk) : n;
      const int64_t v = heap[0] + t;  // the root grows: sift it down
      int64_t i = 0;
      for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= groups) break;
        if (c + 1 < groups && heap[c + 1] < heap[c]) ++c;
        if (heap[c] >= v) break;
        heap[i] = heap[c];
        i = c;
      }
      heap[i] = v;
    }
  }
  int64_t mx = 0;
  for (int64_t i = 0; i < groups; ++i) mx = heap[i] > mx ? heap[i] : mx;
  return mx;
}

// What build_pieces makes (planner.plan_pieces): items, partial slots, the longest chain's load.
struct PieceStats {
  int64_t items, slots, load;
};

// A piece plan's flags in the work item's request word (planner.PIECE_NEXT / PIECE_CONT; the
// kernels read them in decode_common.cuh): the item's CTA runs the next item too / the item is run
// by the previous item's CTA.
constexpr int32_t kPieceNext = 1 << 30, kPieceCont = 1 << 29;

// planner.plan_pieces over ``shares`` shares, in one pass: share g starts at token
// g * total / shares; its cut goes into the request it falls in (cuts come in request order).
// Writes work [items, 4] and merge_indptr [batch + 1] when ``work`` is not null.
inline PieceStats build_pieces(const DecodePlanConfig& m, const Lengths& lens, int64_t batch, int64_t total,
                               int64_t shares, int32_t* work, int32_t* merge) {
  const int64_t align = m.chunk_align;
  PieceStats st{0, 0, 0};
  int64_t g = 1, start = 0, chain = 0;
  bool boundary = true;  // a share starts with this request
  if (merge) merge[0] = 0;
  auto emit = [&](int64_t r, int64_t lo, int64_t hi, int64_t slot, bool new_chain) {
    int32_t flags = 0;
    if (new_chain) {
      if (chain > st.load) st.load = chain;
      chain = 0;
    } else {
      if (work) work[(st.items - 1) * 4] |= kPieceNext;
      flags = kPieceCont;
      chain += m.piece_cost;
    }
    chain += hi - lo;
    if (work) {
      int32_t* w = work + st.items * 4;
      w[0] = (int32_t)r | flags;
      w[1] = (int32_t)lo;
      w[2] = (int32_t)hi;
      w[3] = (int32_t)slot;
    }
    ++st.items;
  };
  for (int64_t r = 0; r < batch; ++r) {
    const int64_t n = lens[r], end = start + n;
    bool next_boundary = false;
    int64_t lo = 0, j = 0;
    for (; g < shares; ++g) {  // the cuts inside this request
      const int64_t c = g * total / shares;
      if (c >= end) break;
      const int64_t local = (c - start) / align * align;
      if (local < m.min_piece) {
        boundary = true;  // only before the request's first cut: local does not decrease
      } else if (n - local < m.min_piece) {
        next_boundary = true;
      } else if (local != lo) {
        emit(r, lo, local, st.slots + j, j > 0 || boundary);
        lo = local;
        ++j;
      }
    }
    emit(r, lo, n, j > 0 ? st.slots + j : -1, j > 0 || boundary);
    if (j > 0) st.slots += j + 1;
    if (merge) merge[r + 1] = (int32_t)st.slots;
    boundary = next_boundary;
    start = end;
  }
  if (chain > st.load) st.load = chain;
  return st;
}

}  // namespace fi_decode_plan

// Plans a batch of ``batch`` >= 1 requests given by their checked page table (int32 ``indptr``
// [batch + 1] and ``last_page_len`` [batch]) into ``out`` (int32, planner.DecodePlan.packed:
// work [n, 4] | n, 0, 0, 0 | merge_indptr [batch + 1]) and ``info`` (int64 [4]: chunk (0 = no
// split, -1 = a piece plan), items, slots, the longest request's tokens). ``fixed_chunk`` > 0
// takes that chunk, ``disable_split`` none, else the search; ``capacity`` < 0 means no item limit
// beyond the search's own.
// Returns 0; 1 when the plan needs more than ``capacity`` items; 2 when ``out`` is null or its
// ``out_len`` entries are too few (info[FI_PLAN_ITEMS] has the count in both cases, nothing is
// written to out); 3 for a bad argument.
FI_EXPORT int fi_plan_decode(const DecodePlanConfig* config, const int32_t* indptr, const int32_t* last_page_len,
                             int64_t batch, int64_t fixed_chunk, int64_t disable_split, int64_t capacity,
                             int32_t* out, int64_t out_len, int64_t* info) {
  if (!config || !indptr || !last_page_len || !info || batch < 1 || config->sm_count < 1 ||
      config->chunk_align < 1 || config->page_size < 1)
    return 3;
  const DecodePlanConfig& m = *config;
  const fi_decode_plan::Lengths lens{indptr, last_page_len, m.page_size};
  int64_t longest = 0, total = 0, shortest = lens[0];
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = lens[b];
    if (len < 0) return 3;
    if (len > longest) longest = len;
    if (len < shortest) shortest = len;
    total += len;
  }
  int64_t chunk = 0;
  bool searched = false;
  if (fixed_chunk > 0 && !disable_split) {
    chunk = fixed_chunk;
  } else if (!disable_split && longest > m.min_chunk) {
    int64_t limit = batch + m.limit_extra;
    if (capacity >= 0 && capacity < limit) limit = capacity;
    chunk = fi_decode_plan::choose_chunk(m, lens, batch, longest, total, limit);
    searched = true;
  }
  if (chunk >= longest) chunk = 0;
  int64_t n_items = batch;
  if (chunk)
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t len = lens[b];
      n_items += len > 0 ? (len - 1) / chunk : 0;
    }
  // planner._pieces_instead: a piece plan for unequal requests where the model puts it ahead
  const int64_t groups = fi_decode_plan::wave_items(m);
  if (searched && m.pieces && shortest != longest && n_items * m.kv_units > m.sm_count &&
      groups <= fi_decode_plan::kMaxPieceGroups) {
    // Counted first (a few hundred ns: cheaper than writing a plan the model may reject, which a
    // measured single-pass form did: +0.7-1.2 us at batch 256 when rejected, -0.3 when taken).
    const fi_decode_plan::PieceStats st =
        fi_decode_plan::build_pieces(m, lens, batch, total, groups, nullptr, nullptr);
    if (100 * fi_decode_plan::chunk_load(lens, batch, chunk, groups) > m.piece_gain_pct * st.load &&
        (capacity < 0 || st.items <= capacity)) {
      info[FI_PLAN_CHUNK] = -1;  // pieces
      info[FI_PLAN_ITEMS] = st.items;
      info[FI_PLAN_SLOTS] = st.slots;
      info[FI_PLAN_LONGEST] = longest;
      if (!out || out_len < st.items * 4 + 4 + batch + 1) return 2;
      fi_decode_plan::build_pieces(m, lens, batch, total, groups, out, out + st.items * 4 + 4);
      out[st.items * 4] = (int32_t)st.items;
      out[st.items * 4 + 1] = out[st.items * 4 + 2] = out[st.items * 4 + 3] = 0;
      return 0;
    }
  }
  info[FI_PLAN_CHUNK] = chunk;
  info[FI_PLAN_ITEMS] = n_items;
  info[FI_PLAN_SLOTS] = 0;
  info[FI_PLAN_LONGEST] = longest;
  if (capacity >= 0 && n_items > capacity) return 1;
  if (!out || out_len < n_items * 4 + 4 + batch + 1) return 2;
  int32_t* work = out;
  int32_t* merge = out + n_items * 4 + 4;
  out[n_items * 4] = (int32_t)n_items;
  out[n_items * 4 + 1] = out[n_items * 4 + 2] = out[n_items * 4 + 3] = 0;
  merge[0] = 0;
  int64_t slot = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = lens[b];
    const int64_t pieces = chunk && len > 0 ? (len - 1) / chunk + 1 : 1;
    for (int64_t p = 0; p < pieces; ++p) {  // (request, first token, end token, slot or -1)
      work[0] = (int32_t)b;
      work[1] = (int32_t)(p * chunk);
      work[2] = (int32_t)(p + 1 < pieces ? (p + 1) * chunk : len);
      work[3] = pieces > 1 ? (int32_t)(slot + p) : -1;
      work += 4;
    }
    if (pieces > 1) slot += pieces;
    merge[b + 1] = (int32_t)slot;
  }
  info[FI_PLAN_SLOTS] = slot;
  return 0;
}

// fi_plan_decode for plan() of host tables, in one call: checks the page table as
// tables.request_lengths does (indptr[0] == 0, indptr non-decreasing, indptr[batch] <=
// ``num_indices``, last_page_len in [1, page_size] for every request with pages), plans it into
// ``out`` like fi_plan_decode, and copies indptr [batch + 1], last_page_len [batch] and, when
// ``indices`` is not null, the indptr[batch] used page ids right behind the plan, so that one
// host-to-device copy carries the plan and its page table. ``capacity`` < 0: the packed layout
// (4 * items + 5 + batch entries); else at most ``capacity`` items, laid out for a CUDA-graph grid
// of ``capacity`` items (work [items, 4] at 0, num_work and merge_indptr at 4 * capacity).
// ``info`` (int64 [5]): fi_plan_decode's four, then indptr[batch].
// Returns 0; 1 when the plan needs more than ``capacity`` items; 2 when ``out_len`` is too small
// for all of it (info holds the items and the page count; nothing is written); 3 for a bad
// argument; 4 for a table that fails a check (the caller raises request_lengths' error).
FI_EXPORT int fi_plan_decode_staged(const DecodePlanConfig* config, const int32_t* indptr,
                                    const int32_t* last_page_len, int64_t batch, int64_t num_indices,
                                    const int32_t* indices, int64_t fixed_chunk, int64_t disable_split,
                                    int64_t capacity, int32_t* out, int64_t out_len, int64_t* info) {
  if (!config || !indptr || !last_page_len || !info || batch < 1 || config->page_size < 1) return 3;
  const int64_t ps = config->page_size;
  if (indptr[0] != 0) return 4;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t pages = (int64_t)indptr[b + 1] - indptr[b];  // int64: no overflow on any int32 pair
    if (pages < 0) return 4;
    if (pages > 0 && (last_page_len[b] < 1 || last_page_len[b] > ps)) return 4;
  }
  const int64_t nnz = indptr[batch];
  if (nnz > num_indices) return 4;
  info[4] = nnz;
  // room for the plan: its own entries, and in the graph layout the idle items' gap
  const int64_t tables = 2 * batch + 1 + (indices ? nnz : 0);
  const int64_t gap_room = capacity >= 0 ? capacity * 4 + 5 + batch : 0;
  const int rc = fi_plan_decode(config, indptr, last_page_len, batch, fixed_chunk, disable_split, capacity, out,
                                capacity >= 0 ? (out_len >= gap_room + tables ? out_len : 0) : out_len - tables,
                                info);
  if (rc) return rc;
  const int64_t n4 = info[FI_PLAN_ITEMS] * 4;
  int64_t head = n4;  // num_work, 0, 0, 0, merge_indptr [batch + 1]
  if (capacity >= 0) {
    head = capacity * 4;
    for (int64_t i = 5 + batch - 1; i >= 0; --i) out[head + i] = out[n4 + i];  // head >= n4: back to front
  }
  int32_t* t = out + head + 5 + batch;
  for (int64_t b = 0; b <= batch; ++b) t[b] = indptr[b];
  t += batch + 1;
  for (int64_t b = 0; b < batch; ++b) t[b] = last_page_len[b];
  t += batch;
  if (indices)
    for (int64_t i = 0; i < nnz; ++i) t[i] = indices[i];
  return 0;
}
