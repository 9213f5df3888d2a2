"""Roles: a persistent kernel's CTAs drawing tasks from device queues, and the controller
that moves CTAs between the queues while the kernel runs.

A fused kernel describes its work as two queues of tasks on a *board* (u64 words in
device memory, one board per op, shape and rank; :mod:`mkrt.controller.board` makes it):

* the **compute** queue: output tiles of the GEMM engine, claimed one at a time by a
  CTA's producer thread (:class:`ClaimedWork` feeds ``gemm::run_tiles``);
* the **communication** queue: tasks in a fixed order (reduce an arrived tile, push it to
  a peer, post it to the proxy, ...), each with its own bounded readiness wait, claimed
  by one thread of the CTA that runs it.

A CTA's *role* is the queue it draws from. It changes role only between tasks, so no task
is ever split or lost, and what a task computes does not depend on which CTA ran it (a
kernel whose tasks sum in a fixed order stays bit-identical between calls). The board's
``TARGET`` says how many CTAs the communication role should have; the controller
(``control_step`` below: the arithmetic of :class:`mkrt.controller.rule.SplitController`)
moves it, both ways, from what the tasks count: compute tiles finished, communication
tasks finished, the time communication CTAs spent waiting, and the tasks left.

* A compute CTA moves to communication when its producer is about to claim a tile, the
  role has fewer CTAs than ``TARGET`` and a control step found communication behind (its
  backlog of ready tasks large and growing: one more CTA per such step, ``MOVE_LIMIT``),
  and when the compute queue is empty (every CTA then helps with the communication left:
  the end of a launch is work-conserving).
* A communication CTA does not go back to compute within a launch: ptxas keeps the
  engine's register split between warpgroups (``setmaxnreg``) only in code reached once,
  and a second entry into the engine spilled about 1,500 registers per copy (H200
  build, 2026-12-03). A ``TARGET`` below the current split takes effect at the next
  launch: the split the controller held while compute work remained is written to
  ``LEARNED`` when a launch ends, and the next launch (or graph replay) starts from it.

``TARGET`` stays in [1, CTAs - 1] while compute tiles remain, so each role with work keeps a
CTA (nothing waits for a role that has no CTA: no deadlock by scheduling). A *static*
board (``STATIC`` = 1) never moves a CTA: the split the host gave holds for the whole
launch, and compute CTAs go to the kernel's final waits when their queue is empty.

How a kernel uses it (gemm_allreduce is the worked example):

    roles::Board board{args.board, gridDim.x, compute_tasks, comm_tasks, comm_fed};
    roles::begin_launch(board);  int role = roles::first_role(board);  // thread 0, then sync
    if (role == roles::COMPUTE) {
        roles::ring_init<Cfg::CONSUMERS>(ring);
        roles::ClaimedWork<gemm::RasterWork> work{board, raster, &ring};  // tiles from the queue
        gemm::run_tiles<Cfg>(..., work, roles::Counted<Epilogue>{epilogue, board}, smem);
        role = roles::after_compute<Cfg>(board, ring);   // registers back; COMM or FINAL
    }
    if (role == roles::COMM)
        for (int task; (task = roles::next_comm_task(board)) >= 0;) {
            ...run task (its waits bounded)...;
            if (threadIdx.x == 0) roles::comm_task_done(board, began_ns, waited_ns);
        }
    ... the kernel's final waits ...;  roles::end_launch(board);   // thread 0; last CTA resets

Trace (``TRACE`` non-zero): every role change of every CTA with its time, and every
control step's signals and decision, for the role-timeline plot of experiments/controller.py.
"""

from mkrt.jit.render import cuda_source

ROLES = cuda_source("roles", r"""
namespace mkrt {
namespace roles {

// Board words (u64). mkrt/controller/board.py has the same list (a CPU test compares).
enum Word {
    NEXT_COMPUTE,   // compute tasks claimed this launch
    NEXT_COMM,      // communication tasks claimed this launch
    IN_COMM,        // CTAs in the communication role now
    TARGET,         // CTAs the controller wants there
    COMPUTED,       // compute tasks finished this launch
    COMMUNICATED,   // communication tasks finished this launch
    EXITED,         // CTAs out of this launch
    STEP_LOCK,      // a control step is being taken
    STEP_TASKS,     // communication tasks finished since the last step
    STEP_WAIT_NS,   // their time in readiness waits
    STEP_BUSY_NS,   // their whole time
    STEP_COMPUTED,  // COMPUTED at the last step
    SUM_COMPUTED,   // the rule's accumulators (SplitController._sum)
    SUM_REDUCED,
    SUM_WAIT,
    SUM_STEPS,
    LAST_MOVE,      // 0 none, 1 towards communication, 2 towards compute
    REVERSALS,
    FROZEN,
    LAST_BACKLOG,
    MOVES,
    STEADY,         // the split while compute work remained
    LEARNED,        // where the next launch starts
    STATIC,         // 1: never move a CTA
    SWITCHES,       // role changes this launch
    STEPS,          // control steps this launch
    LAUNCHES,       // launches finished
    LAST_SWITCHES,  // the last launch's SWITCHES, STEPS, MOVES (kept for the host)
    LAST_STEPS,
    LAST_MOVES,
    START_NS,       // when the first CTA of this launch began
    TRACE,          // 0, or a trace buffer (see trace_event / trace_step)
    TRACE_EVENTS,   // events per CTA in the trace buffer
    TRACE_STEPS,    // control-step records in the trace buffer
    MOVE_LIMIT,     // communication CTAs compute CTAs may make up within this launch
    SEARCH,         // 1: roles="search" (after RULE_LAUNCHES launches, search by launch time)
    SEARCHING,      // 1: the search has begun (no moves within a launch any more)
    S_BEST,         // the search (controller/rule.py LaunchSearch): best split so far,
    S_BEST_NS,      //   its average launch time (0: not measured yet),
    S_TRIAL,        //   the split being measured,
    S_STEP,         //   the climb's step,
    S_DOWN,         //   its direction (1: towards fewer communication CTAs),
    S_TRIED_DOWN,   //   best - step tried at this step,
    S_SETTLED,      //   settled on S_BEST,
    S_N,            //   launches measured at S_TRIAL,
    S_SUM_NS,       //   and their summed time
    LAST_NS,        // the last launch's time, first CTA in to last CTA out
    WORDS
};

enum Role { COMPUTE = 0, COMM = 1, FINAL = 2, DONE = 3 };

// The rule's constants (mkrt/controller/rule.py SplitController defaults; a CPU test
// compares).
constexpr int MIN_TILES = 4, BACKLOG_HIGH = 2, IDLE_PERMILLE = 900, SETTLE = 2, MIN_REDUCE = 1;
// The search's (LaunchSearch defaults; a CPU test compares): launches under the rate rule
// first, launches averaged per split, the gain that makes a split the best.
constexpr int RULE_LAUNCHES = 4, SEARCH_SAMPLES = 2, MIN_GAIN_PERMILLE = 10;
// Trace records: per CTA [count, (time, role) x TRACE_EVENTS]; then [count, step x
// TRACE_STEPS] with STEP_RECORD words per step.
constexpr int STEP_RECORD = 9;

struct Board {
    u64* w;
    int ctas;
    int compute_tasks;   // tiles in the compute queue
    int comm_tasks;      // tasks in the communication queue
    int comm_fed;        // the first comm_fed of them become ready as tiles are computed
};

__device__ __forceinline__ u64 load(const Board& b, int word) { return ld_acquire_gpu(b.w + word); }
__device__ __forceinline__ u64 add(const Board& b, int word, u64 v) {
    return atomicAdd((unsigned long long*)(b.w + word), (unsigned long long)v);
}
__device__ __forceinline__ u64 exchange(const Board& b, int word, u64 v) {
    return atomicExch((unsigned long long*)(b.w + word), (unsigned long long)v);
}

// ---- trace ----------------------------------------------------------------------------
__device__ __forceinline__ void trace_event(const Board& b, int role) {
    u64* trace = (u64*)b.w[TRACE];
    if (!trace) return;
    const u64 events = b.w[TRACE_EVENTS];
    u64* mine = trace + blockIdx.x * (1 + 2 * events);
    const u64 n = mine[0];
    if (n >= events) return;
    mine[1 + 2 * n] = global_timer_ns();
    mine[2 + 2 * n] = (u64)role;
    mine[0] = n + 1;
}

__device__ void trace_step(const Board& b, const u64 (&record)[STEP_RECORD]) {
    u64* trace = (u64*)b.w[TRACE];
    if (!trace) return;
    u64* steps = trace + (u64)b.ctas * (1 + 2 * b.w[TRACE_EVENTS]);
    const u64 n = steps[0];
    if (n >= b.w[TRACE_STEPS]) return;
    for (int i = 0; i < STEP_RECORD; ++i) steps[1 + n * STEP_RECORD + i] = record[i];
    steps[0] = n + 1;
}

// ---- the controller (SplitController.update, one thread at a time) -------------------
struct Signals {
    i64 computed, reduced, wait_permille, compute_left, backlog, reduce_left;
    i64 reduce_ctas;    // CTAs in the communication role during the step (IN_COMM)
};

__device__ __forceinline__ i64 clamp_split(const Board& b, i64 reduce, const Signals& s) {
    const i64 low = max((i64)MIN_REDUCE, (i64)(s.reduce_left > 0 ? 1 : 0));
    const i64 high = (i64)b.ctas - (s.compute_left > 0 ? 1 : 0);
    return max(low, min(high, reduce));
}

__device__ __forceinline__ void set_split(const Board& b, i64 reduce, bool steady) {
    if ((u64)reduce != b.w[TARGET]) b.w[MOVES] += 1;
    st_release_gpu(b.w + TARGET, (u64)reduce);
    if (steady) b.w[STEADY] = (u64)reduce;
}

__device__ i64 aim(const Board& b, i64 reduce, i64 computed, i64 reduced, i64 wait,
                   bool behind, bool idle, i64 actual) {
    if (idle) return max((i64)MIN_REDUCE, reduce / 2);
    const i64 busy = 1000 - wait;
    if (computed <= 0 || reduced <= 0 || busy <= 0) return behind ? reduce + 1 : reduce;
    const i64 ctas = b.ctas;
    // rates per CTA of the split that did the work (`actual` communication CTAs)
    actual = max((i64)1, min(ctas - 1, actual));
    const double c = (double)computed * (double)b.comm_tasks / (double)(ctas - actual);
    const double r = (double)reduced * 1000.0 * (double)b.compute_tasks / ((double)actual * (double)busy);
    const i64 low = (i64)((double)ctas * c / (c + r));
    i64 best = -1;
    double best_value = 0.0;
    for (i64 k = low; k <= low + 1; ++k) {
        if (k < 1 || k > ctas - 1) continue;
        const double value = fmin((double)(ctas - k) * c, (double)k * r);
        if (best < 0 || value > best_value) { best = k; best_value = value; }
    }
    return best < 0 ? reduce : best;
}

__device__ void rule_update(const Board& b, const Signals& s) {
    u64* w = b.w;
    const i64 reduce = (i64)w[TARGET];
    if (s.compute_left == 0) { set_split(b, clamp_split(b, b.ctas, s), false); return; }
    w[SUM_COMPUTED] += (u64)s.computed;
    w[SUM_REDUCED] += (u64)s.reduced;
    w[SUM_WAIT] += (u64)s.wait_permille;
    w[SUM_STEPS] += 1;
    const i64 wait = (i64)(w[SUM_WAIT] / w[SUM_STEPS]);
    const bool behind = s.backlog > BACKLOG_HIGH * reduce && s.backlog > (i64)w[LAST_BACKLOG];
    w[LAST_BACKLOG] = (u64)s.backlog;
    // Within a launch a compute CTA moves only on evidence that communication is behind,
    // one CTA per step (a move cannot be undone before the launch ends; the rule's rate
    // balance, noisy early in a launch, sets where the next launch starts).
    if (behind && s.reduce_ctas + 1 > (i64)w[MOVE_LIMIT]) st_release_gpu(w + MOVE_LIMIT, (u64)(s.reduce_ctas + 1));
    const bool idle = wait > IDLE_PERMILLE && !behind;
    // a rate is trusted after MIN_TILES tiles, or a sixteenth of the launch's tiles
    const i64 min_tiles = max((i64)MIN_TILES, (i64)b.compute_tasks / 16);
    if (w[FROZEN] || ((i64)w[SUM_COMPUTED] < min_tiles && !idle && !behind)) {
        set_split(b, clamp_split(b, reduce, s), true);
        return;
    }
    const i64 goal = aim(b, reduce, (i64)w[SUM_COMPUTED], (i64)w[SUM_REDUCED], wait, behind, idle,
                         s.reduce_ctas > 0 ? s.reduce_ctas : reduce);
    w[SUM_COMPUTED] = w[SUM_REDUCED] = w[SUM_WAIT] = w[SUM_STEPS] = 0;
    if (goal == reduce) { set_split(b, clamp_split(b, reduce, s), true); return; }
    const i64 direction = goal > reduce ? 1 : -1;
    const i64 distance = goal > reduce ? goal - reduce : reduce - goal;
    const i64 move = direction * max((i64)1, distance / 2);
    const i64 last = w[LAST_MOVE] == 0 ? 0 : (w[LAST_MOVE] == 1 ? 1 : -1);
    if (last != 0 && direction != last && (move == 1 || move == -1)) {
        w[REVERSALS] += 1;
        if ((i64)w[REVERSALS] >= SETTLE) {
            w[FROZEN] = 1;
            set_split(b, clamp_split(b, reduce, s), true);
            return;
        }
    }
    w[LAST_MOVE] = direction > 0 ? 1 : 2;
    set_split(b, clamp_split(b, reduce + move, s), true);
}

// A control step: whichever thread takes the lock runs the rule on what was counted since
// the last step. Communication CTAs take it between tasks (compute CTAs only count tiles:
// a call from the engine's consumers cost them registers).
__device__ void control_step(const Board& b) {
    if (atomicCAS((unsigned long long*)(b.w + STEP_LOCK), 0ull, 1ull) != 0ull) return;
    __threadfence();
    const u64 now = global_timer_ns();
    const u64 done = exchange(b, STEP_TASKS, 0);
    const u64 wait = exchange(b, STEP_WAIT_NS, 0);
    const u64 busy = exchange(b, STEP_BUSY_NS, 0);
    const u64 computed_now = load(b, COMPUTED);
    Signals s;
    s.computed = (i64)(computed_now - b.w[STEP_COMPUTED]);
    b.w[STEP_COMPUTED] = computed_now;
    s.reduced = (i64)done;
    s.wait_permille = busy ? (i64)min((u64)1000, wait * 1000 / busy) : 0;
    const i64 claimed = (i64)load(b, NEXT_COMPUTE);
    s.compute_left = claimed < b.compute_tasks ? b.compute_tasks - claimed : 0;
    // tasks the finished tiles have made ready that no CTA has taken (an estimate: the
    // fed tasks become ready in proportion to the tiles computed)
    const i64 ready = b.compute_tasks ? (i64)computed_now * b.comm_fed / b.compute_tasks : 0;
    const i64 taken = (i64)load(b, NEXT_COMM);
    s.backlog = ready > taken ? ready - taken : 0;
    const i64 finished = (i64)load(b, COMMUNICATED);
    s.reduce_left = finished < b.comm_tasks ? b.comm_tasks - finished : 0;
    s.reduce_ctas = (i64)load(b, IN_COMM);
    rule_update(b, s);
    b.w[STEPS] += 1;
    const u64 record[STEP_RECORD] = {now, (u64)s.computed, (u64)s.reduced, (u64)s.wait_permille,
                                     (u64)s.compute_left, (u64)s.backlog, (u64)s.reduce_left,
                                     (u64)s.reduce_ctas, b.w[TARGET]};
    trace_step(b, record);
    __threadfence();
    st_release_gpu(b.w + STEP_LOCK, 0);
}

// One thread of a communication CTA that finished a task: count it; a control step every
// max(4, communication CTAs) tasks, or sooner once max(8, CTAs / 2) tiles were computed
// since the last one (a multi-node task is a whole group of tiles: few and long).
__device__ void comm_task_done(const Board& b, u64 began_ns, u64 waited_ns) {
    const u64 now = global_timer_ns();
    add(b, COMMUNICATED, 1);
    if (b.w[STATIC]) return;
    add(b, STEP_WAIT_NS, waited_ns);
    add(b, STEP_BUSY_NS, now > began_ns ? now - began_ns : 1);
    const u64 tasks = add(b, STEP_TASKS, 1) + 1;
    const u64 in_comm = load(b, IN_COMM);
    const u64 computed = load(b, COMPUTED) - load(b, STEP_COMPUTED);
    const u64 every = b.ctas / 2 > 8 ? (u64)(b.ctas / 2) : 8;
    if (tasks >= (in_comm > 4 ? in_comm : 4) || computed >= every) control_step(b);
}

// ---- launches and roles ---------------------------------------------------------------

// Thread 0 of every CTA at the start of a launch.
__device__ __forceinline__ void begin_launch(const Board& b) {
    atomicMin((unsigned long long*)(b.w + START_NS), (unsigned long long)global_timer_ns());
}

// The role a CTA starts in: the last LEARNED CTAs communicate. LEARNED changes only when
// a launch ends, so every CTA of a launch reads the same split however late it starts
// (IN_COMM, which starts equal to it, moves as soon as CTAs change roles).
__device__ __forceinline__ int first_role(const Board& b) {
    const int start = (int)b.w[LEARNED];
    const int role = (int)blockIdx.x >= b.ctas - start ? COMM : COMPUTE;
    trace_event(b, role);
    return role;
}

// The producer thread of a compute CTA, before each tile: the next tile, or -1 (leave the
// compute role: the queue is empty, or the board wants another communication CTA).
// *left_because: 1 the queue is empty, 2 moved by the controller.
__device__ __forceinline__ int claim_tile(const Board& b, int* left_because) {
    if (!b.w[STATIC] && !b.w[SEARCHING] && load(b, NEXT_COMPUTE) < (u64)b.compute_tasks) {
        const u64 target = min(load(b, TARGET), load(b, MOVE_LIMIT));
        const u64 in_comm = load(b, IN_COMM);
        if (in_comm < target) {
            const u64 before = add(b, IN_COMM, 1);
            if (before < min(load(b, TARGET), load(b, MOVE_LIMIT))) { *left_because = 2; return -1; }
            add(b, IN_COMM, ~0ull);        // someone else moved first
        }
    }
    const u64 tile = add(b, NEXT_COMPUTE, 1);
    if (tile >= (u64)b.compute_tasks) { *left_because = 1; return -1; }
    return (int)tile;
}

// A work list for gemm::run_tiles whose tiles come from a queue (the board's compute
// queue, or a plain CountedQueue; the ring that passes a claim to the consumers is in
// tile_queue). Inner maps a queue position to a Tile (e.g. gemm::RasterWork::tile_at).
__device__ __forceinline__ int claim(const Board& b, int* left_because) { return claim_tile(b, left_because); }

template <class Inner, class Source = Board>
struct ClaimedWork {
    Source source;             // where positions come from: a Board or a CountedQueue
    Inner inner;
    Ring* ring;

    __device__ __forceinline__ bool get(int i, gemm::Tile& tile) const {
        const int position = claimed_position(source, ring, i);
        if (position < 0) return false;
        tile = inner.tile_at(position);
        return true;
    }
    __device__ __forceinline__ bool wait(const gemm::Tile& tile) const { return inner.wait(tile); }
};

// The kernel's epilogue, then the tile counted as done (a controller signal).
template <class Inner>
struct Counted {
    Inner inner;
    Board board;

    template <int CONSUMERS>
    __device__ __forceinline__ void finish(const gemm::ConsumerThread<CONSUMERS>& who) const { inner.finish(who); }
    template <int CONSUMERS>
    __device__ __forceinline__ void complete(const gemm::ConsumerThread<CONSUMERS>& who) const { inner.complete(who); }
    template <class Acc, int CONSUMERS>
    __device__ __forceinline__ void operator()(const gemm::Tile& tile, const Acc& acc,
                                               const gemm::ConsumerThread<CONSUMERS>& who) const {
        inner(tile, acc, who);
        if (who.leader()) add(board, COMPUTED, 1);
    }
};

// After gemm::run_tiles returned: give the warpgroups the registers they had at launch
// (the engine moved them to the consumers), and say which role the CTA takes next.
template <class Cfg>
__device__ __forceinline__ int after_compute(const Board& b, Ring& ring) {
    constexpr int LAUNCH_REGISTERS = (65536 / Cfg::THREADS > 256 ? 256 : 65536 / Cfg::THREADS) & ~7;
    // every warp of a warpgroup executes its setmaxnreg together (the producer thread
    // leaves the engine later than the rest of its warpgroup): named barriers 6 and 7
    if (threadIdx.x < 128) {
        asm volatile("bar.sync 6, 128;" ::: "memory");
        warpgroup_registers_increase<LAUNCH_REGISTERS>();
    } else {
        asm volatile("bar.sync 7, %0;" :: "n"(Cfg::THREADS - 128) : "memory");
        warpgroup_registers_decrease<LAUNCH_REGISTERS>();
    }
    __syncthreads();
    // moved by the controller: IN_COMM already counts it. Queue empty: join (a static
    // board's compute CTAs go to the kernel's final waits instead).
    const int because = ring.left_because;
    __syncthreads();
    int next;
    if (because == 2) next = COMM;
    else next = b.w[STATIC] ? FINAL : COMM;
    if (threadIdx.x == 0) {
        if (because != 2 && next == COMM) add(b, IN_COMM, 1);
        if (next == COMM) add(b, SWITCHES, 1);
        trace_event(b, next);
    }
    return next;
}

// The whole CTA, between communication tasks: the next task, or -1 (the queue is empty).
__device__ __forceinline__ int next_comm_task(const Board& b) {
    __shared__ int task_shared;
    if (threadIdx.x == 0) {
        const u64 task = add(b, NEXT_COMM, 1);
        task_shared = task < (u64)b.comm_tasks ? (int)task : -1;
        if (task_shared < 0) trace_event(b, FINAL);
    }
    __syncthreads();
    const int task = task_shared;
    __syncthreads();
    return task;
}

// A kernel whose roles stay fixed within a launch (a static split passed as an argument)
// can still take the search between launches: every CTA calls split_for_launch at the
// start (thread 0 reads, the CTA shares it; the same for every CTA of a launch) and
// leave_launch as it leaves (below). board: null for the argument's split.
__device__ __forceinline__ int split_for_launch(u64* board, int compute_ctas) {
    __shared__ int compute_shared;
    if (threadIdx.x == 0) {
        int compute = compute_ctas;
        if (board) {
            begin_launch(Board{board, (int)gridDim.x, 0, 0, 0});
            compute = (int)gridDim.x - (int)board[LEARNED];
        }
        compute_shared = compute;
    }
    __syncthreads();
    return compute_shared;
}

// ---- the search by launch time (roles="search"; LaunchSearch in controller/rule.py) -----

__device__ u64 search_next(u64* w, int ctas) {
    while (w[S_STEP] > 0) {
        i64 trial = (i64)w[S_BEST] + (w[S_DOWN] ? -(i64)w[S_STEP] : (i64)w[S_STEP]);
        trial = max((i64)1, min((i64)ctas - 1, trial));
        if (trial != (i64)w[S_BEST]) { w[S_TRIAL] = (u64)trial; return (u64)trial; }
        // at the edge: nothing to try this way
        if (!w[S_DOWN] && !w[S_TRIED_DOWN]) { w[S_DOWN] = 1; w[S_TRIED_DOWN] = 1; }
        else { w[S_STEP] /= 2; w[S_DOWN] = 0; w[S_TRIED_DOWN] = 0; }
    }
    w[S_SETTLED] = 1;
    w[S_TRIAL] = w[S_BEST];
    return w[S_BEST];
}

// A launch at S_TRIAL took `ns`: the split of the next launch.
__device__ u64 search_step(u64* w, int ctas, u64 ns) {
    w[S_N] += 1;
    w[S_SUM_NS] += ns;
    if (w[S_SETTLED]) { w[S_N] = 0; w[S_SUM_NS] = 0; return w[S_TRIAL]; }
    if (w[S_N] < (u64)SEARCH_SAMPLES) return w[S_TRIAL];
    const u64 average = w[S_SUM_NS] / w[S_N];
    w[S_N] = 0;
    w[S_SUM_NS] = 0;
    if (w[S_BEST_NS] == 0) {
        w[S_BEST_NS] = average;                        // the starting split, measured
    } else if (average * 1000 < w[S_BEST_NS] * (1000 - MIN_GAIN_PERMILLE)) {
        w[S_BEST] = w[S_TRIAL];
        w[S_BEST_NS] = average;
        w[S_TRIED_DOWN] = 1;                           // the other side is where it came from
    } else if (!w[S_DOWN] && !w[S_TRIED_DOWN]) {
        w[S_DOWN] = 1;
        w[S_TRIED_DOWN] = 1;
    } else {
        w[S_STEP] /= 2;
        w[S_DOWN] = 0;
        w[S_TRIED_DOWN] = 0;
    }
    return search_next(w, ctas);
}

__device__ void search_begin(u64* w, int ctas, u64 start) {
    w[S_BEST] = start;
    w[S_TRIAL] = start;
    w[S_BEST_NS] = 0;
    w[S_STEP] = ctas / 8 > 1 ? (u64)(ctas / 8) : 1;
    w[S_DOWN] = 0;
    w[S_TRIED_DOWN] = 0;
    w[S_SETTLED] = 0;
    w[S_N] = 0;
    w[S_SUM_NS] = 0;
    w[SEARCHING] = 1;
}

// Thread 0 of every CTA when it leaves the kernel; the last one out resets the board for
// the next launch, which starts from the split this one learned (or, searching, the split
// the search measures next).
__device__ void end_launch(const Board& b) {
    trace_event(b, DONE);
    __threadfence();
    if (add(b, EXITED, 1) != (u64)b.ctas - 1) return;
    __threadfence();
    u64* w = b.w;
    const u64 now = global_timer_ns();
    const u64 duration = now > w[START_NS] ? now - w[START_NS] : 1;
    w[LAST_NS] = duration;
    u64 learned = w[STATIC] ? w[LEARNED] : w[STEADY];
    if (w[SEARCH] && !w[STATIC]) {
        if (w[SEARCHING]) {
            learned = search_step(w, b.ctas, duration);
        } else if (w[LAUNCHES] + 1 >= (u64)RULE_LAUNCHES) {
            search_begin(w, b.ctas, learned);          // from the rule's split
        }
    }
    learned = learned < 1 ? 1 : (learned > (u64)b.ctas - 1 ? (u64)b.ctas - 1 : learned);
    w[LAST_SWITCHES] = w[SWITCHES];
    w[LAST_STEPS] = w[STEPS];
    w[LAST_MOVES] = w[MOVES];
    w[LAUNCHES] += 1;
    w[LEARNED] = learned;
    w[TARGET] = learned;
    w[IN_COMM] = learned;
    w[STEADY] = learned;
    w[MOVE_LIMIT] = learned;
    const int clear[] = {NEXT_COMPUTE, NEXT_COMM, COMPUTED, COMMUNICATED, STEP_LOCK, STEP_TASKS,
                         STEP_WAIT_NS, STEP_BUSY_NS, STEP_COMPUTED, SUM_COMPUTED, SUM_REDUCED,
                         SUM_WAIT, SUM_STEPS, LAST_MOVE, REVERSALS, FROZEN, LAST_BACKLOG, MOVES,
                         SWITCHES, STEPS};
    for (int word : clear) w[word] = 0;
    w[START_NS] = ~0ull;
    __threadfence();
    w[EXITED] = 0;
}

// A fixed-role kernel's CTAs as they leave (see split_for_launch): thread 0 counts its CTA
// out; the last one runs the search.
__device__ __forceinline__ void leave_launch(u64* board) {
    if (board && threadIdx.x == 0) end_launch(Board{board, (int)gridDim.x, 0, 0, 0});
}

}  // namespace roles
}  // namespace mkrt
""", requires=("tile_queue", "gemm_tile", "tma", "wgmma", "base"))
