/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/*
 * Every type shared between rprof's BPF program and its userspace, defined
 * once. Rust uses the copies libbpf-cargo generates from this header's BTF
 * (the skeleton's `types` module); nothing here is duplicated by hand.
 */
#ifndef RPROF_H
#define RPROF_H

/* Deepest stack kept; deeper stacks lose frames at the root end. */
#define RPROF_MAX_FRAMES 4096
/* Control frames copied from the target per read. */
#define RPROF_CFP_CHUNK	   32
#define RPROF_MAX_CFP_SIZE 64
/* Bytes of the VM value stack (where every frame's env lives) copied per sample. */
#define RPROF_VSTACK_WINDOW (16 * 1024)
/* Blocks nested this deep are followed to their method's env. */
#define RPROF_ENV_CHAIN_MAX 8
/* --native: deepest native stack kept (the root end is cut beyond it). */
#define RPROF_MAX_NATIVE 512
/* --kernel: deepest kernel stack kept (the kernel's own limit). */
#define RPROF_MAX_KERNEL 127
/* Executable mappings of one address space BPF can unwind through. */
#define RPROF_MAX_MAPPINGS 512
/* Words of the maybe-followed PID bitmaps: PID_MAX_LIMIT (4,194,304) / 64. */
#define RPROF_PID_WORDS 65536

/* How the BPF program finds a thread's current execution context (EC). */
enum rprof_ec_access {
	/* ec = *(ec_addr): Ruby < 3.0, one global for the GVL holder. */
	RPROF_EC_GLOBAL = 0,
	/* ec = *(dtv[tls_module].val + ec_addr), dtv = *(tp + 8): dynamic TLS (PIC libruby). */
	RPROF_EC_TLS_DTV = 1,
	/* ec = *(tp + (s64)ec_addr): static TLS (initial or local exec). */
	RPROF_EC_TLS_TPOFF = 2,
	/* ec = *(th + ec_addr), th = threads[{pid, tp}]: Ruby < 3.0, whose one
	 * global EC is the GVL holder's; userspace maps each native thread to its
	 * rb_thread_t from the VM's thread list. */
	RPROF_EC_THREAD_MAP = 3,
};

/* Key of the `threads` map: a native thread of a target process. */
struct rprof_thread_key {
	__u32 pid;
	__u32 pad;
	__u64 tp; /* thread pointer: pthread_self() */
};

/* One thread of the process the `thread_pointers` iterator was asked about:
 * what userspace needs to follow the recipe from that thread's own TLS, as
 * BPF does, before the first sample. */
struct rprof_thread_pointer {
	__u32 tid;
	__u32 pad;
	__u64 tp; /* the thread pointer (fs base) */
};

/* A process's start, as /proc/PID/stat gives it: boot time in clock ticks
 * (USER_HZ, 100 a second). With the PID, it names one process: a PID is
 * reused only by a process started later. */
#define RPROF_TICK_NS 10000000ULL

/* Per-process recipe, written by userspace into the `procs` map (key: tgid),
 * and copied by BPF to a followed process's forked children. */
struct rprof_proc {
	__u64 start_ticks; /* events of another process with this PID are ignored */
	__u64 ec_addr;
	__u64 tls_module;
	__u32 ec_access;      /* enum rprof_ec_access */
	__u32 dtv_entry_size; /* 16 for glibc, 8 for musl */
	/* rb_execution_context_t */
	__u32 ec_vm_stack;
	__u32 ec_vm_stack_size;
	__u32 ec_cfp;
	__u32 ec_thread_ptr;
	/* rb_thread_t -> native pthread id, through an optional pointer hop */
	__u32 th_native_thread; /* offset of the native thread pointer; 0: none */
	__u32 th_native_id;	/* offset of the pthread id */
	__u32 verify_thread;	/* 1: drop ECs whose pthread id is not this thread's */
	/* rb_control_frame_t */
	__u32 cfp_size;
	__u32 cfp_pc;
	__u32 cfp_iseq;
	__u32 cfp_ep;
	__u32 cfp_jit_return; /* 0: no such field (Ruby 2.7) */
	/* RPROF_EC_TLS_DTV: written by BPF (one 8-byte store) once it sees the
	 * TLS block is in static TLS, at this same offset from every thread's
	 * pointer; 0 until then. */
	__s64 tls_tp_offset;
	/* Written by BPF: the GC time it last sent a reading of the GC's clock
	 * at (RPROF_SAMPLE_CLOCK); 0 before the first. */
	__u64 clock_sent;
	/* env data at ep[-2..0] */
	__u64 frame_magic_mask;
	__u64 frame_magic_cfunc;
	__u64 env_flag_local;
	__u64 imemo_ment_mask;	 /* applied to an object's flags ... */
	__u64 imemo_ment_value;	 /* ... equals this for a method entry */
	__u64 imemo_svar_value;	 /* ... for a method's $~/$_ store (struct vm_svar) ... */
	__u64 imemo_ifunc_value; /* ... for a block written in C */
	__u64 svar_cref_or_me;	 /* ... which holds the method entry here */
	/* The GC's clock (see src/gc_time.rs): objspace->flags (32 bits, mode
	 * in bits 0-1) and objspace->profile.count, absolute addresses. */
	__u64 gc_flags_addr;
	__u64 gc_count_addr;
	/* wall: the fields whose sum is GC.stat(:time), the ns of the process's
	 * CPU time the GC has taken (3.1+; 0: none), absolute addresses */
	__u64 gc_time_addr[2];
	/* objspace->flags' during_minor_gc bit: 9 (2.7, 3.1) or 10 (3.2+) */
	__u32 gc_minor_bit;
	/* profile.major_gc_count's and minor_gc_count's offsets from
	 * profile.count: a collection's count is raised before it starts
	 * marking, and its kind's count only after during_minor_gc is set for
	 * it; until then the bit is the last collection's (see read_gc_time). */
	__s32 gc_major_from_count;
	__s32 gc_minor_from_count;
	/* rb_thread_t, Ruby 3.3+: a Ruby thread without a dedicated native
	 * thread (M:N) is named after itself, not after the native thread. */
	__u32 th_dedicated_byte;
	__u32 th_dedicated_mask; /* 0: no M:N threads in this Ruby */
	/* --native: the key in `spaces` of this process's executable mappings
	 * (shared by the forks that have not changed them); 0: none yet. */
	__u32 native_space;
	/* Ruby frame flags (ep[0]) copied into rprof_frame.flags. */
	__u32 frame_flag_finish;
	/* RBasic.flags bits all set in an old (promoted) object. */
	__u64 fl_promoted;
	/* wall: why a thread is off CPU, from its rb_thread_t at switch-out
	 * (enum rprof_wall_state). th_status_mask 0: the layout has none. */
	__u32 th_status_byte; /* status: (byte >> shift) & mask, enum rb_thread_status */
	__u32 th_status_shift;
	__u32 th_status_mask;
	__u32 th_blocking_region; /* blocking_region_buffer: set while the GVL is released */
	__u32 th_unblock_func;	  /* unblock.func */
	__u32 th_locking_mutex;	  /* the Mutex it waits for, or Qfalse (0) */
	__u32 th_gvl_node;	  /* the GVL wait queue's list node in rb_thread_t (next) */
	__u32 th_gvl_node_ubf;	  /* 1: the node is shared with the ubf list (2.7, 3.1) */
	__u32 th_gvl_base;	  /* th->ractor (3.x) or th->vm (2.7): where the GVL is */
	__u32 gvl_holder;	  /* the GVL holder's rb_thread_t, from there */
	__u32 th_read_len;	  /* bytes of rb_thread_t read at once: past all of these */
	__u32 wall_pad;
	/* wall: monotonic ns from which this process's threads are accounted
	 * (when it was followed); a thread first seen switching in, off CPU
	 * since before then, counts the gap as unseen. */
	__u64 wall_since;
};

/*
 * One Ruby frame as the VM knows it; userspace turns it into label/path/line.
 * Ruby frame: iseq != 0, pc != 0, cme is the method entry (0 at top level).
 * C frame:    iseq == 0, cme is the callable method entry of the C method.
 */
struct rprof_frame {
	__u64 iseq;
	__u64 pc;
	__u64 cme;
	__u32 flags; /* enum rprof_frame_flags */
	__u32 pad;
};

enum rprof_frame_flags {
	/* VM_FRAME_FLAG_FINISH: the first frame a native call into the VM
	 * (rb_vm_exec) runs; the frames up to the next one are that call's. */
	RPROF_FRAME_FINISH = 1,
	/* cfp->jit_return is set: YJIT pushed or entered the frame, and writes
	 * its pc only before calls, so the running frame's pc may be stale. */
	RPROF_FRAME_JIT = 2,
	/* The frame's iseq (method entry) was old when the record was sent:
	 * only a major GC frees or moves it, so what userspace reads there
	 * later, after minor GCs only, is still that object. Set only on
	 * records, where userspace names frames. */
	RPROF_FRAME_ISEQ_OLD = 4,
	RPROF_FRAME_CME_OLD = 8,
	/* The iseq slot holds an ifunc: a block written in C, which Ruby's
	 * backtraces leave out (records only). */
	RPROF_FRAME_IFUNC = 16,
};

/*
 * --native: how one native frame is unwound, a rule shared by every pc it
 * covers (from .eh_frame CFI, built by userspace, src/unwind/). Registers
 * are x86-64's; DWARF numbers them rax 0, rdx 1, rcx 2, rbx 3, rsi 4, rdi 5,
 * rbp 6, rsp 7, r8-r15 8-15. The return address is always at CFA - 8.
 */
enum rprof_cfa_kind {
	RPROF_CFA_NONE = 0,   /* no CFI covers the pc: frame pointers, if the file keeps them */
	RPROF_CFA_RSP = 1,    /* cfa = rsp + cfa_off */
	RPROF_CFA_RBP = 2,    /* cfa = rbp + cfa_off */
	RPROF_CFA_REG = 3,    /* cfa = reg + cfa_off, any register: the leaf frame only */
	RPROF_CFA_DEREF = 4,  /* cfa = *(reg + cfa_off) + deref_off, reg rsp or rbp */
	RPROF_CFA_PLT = 5,    /* GCC's PLT stubs: cfa = rsp + 8 + ((pc & 15) >= cfa_off ? 8 : 0) */
	RPROF_CFA_SIGNAL = 6, /* a signal trampoline: registers from the ucontext at rsp */
	RPROF_CFA_END = 7,    /* return address undefined: the outermost frame */
	RPROF_CFA_UNSUPPORTED = 8, /* CFI rprof cannot follow (another expression) */
};

enum rprof_rbp_kind {
	RPROF_RBP_SAME = 0,    /* rbp is not changed by this frame */
	RPROF_RBP_AT_CFA = 1,  /* rbp = *(cfa + rbp_off) */
	RPROF_RBP_UNKNOWN = 2, /* restored some other way: unknown from here on */
};

struct rprof_unwind_rule {
	__u8 cfa; /* enum rprof_cfa_kind */
	__u8 reg; /* DWARF register of RPROF_CFA_REG / RPROF_CFA_DEREF */
	__u8 rbp; /* enum rprof_rbp_kind */
	__u8 pad;
	__s32 cfa_off;
	__s32 rbp_off;
	__s32 deref_off;
};

/* A rule from `pc` (an offset from the file's `base`) up to the next row's.
 * The row `back` rows before this one starts its function (0: this one). */
struct rprof_unwind_row {
	__u32 pc;
	__u16 rule; /* index in `unwind_rules` */
	__u16 back; /* 0xffff: unknown */
};

/* A lookup searches only the rows of its pc's page, of 1 << this many bytes
 * (an enum, so that Rust gets it too). */
enum rprof_unwind_page {
	RPROF_UNWIND_PAGE_SHIFT = 12,
};

/* One ELF file's rows: unwind_rows[first .. first + count), sorted by pc;
 * unwind_pages[first_page + p] is the row covering the start of page p (of
 * pages pages, from base). */
struct rprof_unwind_file {
	__u32 first;
	__u32 count;
	__u64 base;
	__u32 flags; /* enum rprof_file_flags */
	__u32 first_page;
	__u32 pages;
	__u32 pad;
};

enum rprof_file_flags {
	/* Built with frame pointers: a pc without CFI is unwound through rbp. */
	RPROF_FILE_FRAME_POINTERS = 1,
};

enum rprof_mapping_kind {
	RPROF_MAPPING_FILE = 0, /* an ELF file: `file` names its rows (0: none) */
	RPROF_MAPPING_JIT = 1,	/* anonymous executable memory (YJIT's code): frame pointers */
};

/* An executable mapping: an address in [start, end) is the file's vaddr addr - bias. */
struct rprof_mapping {
	__u64 start;
	__u64 end;
	__u64 bias;
	__u32 file;
	__u32 kind; /* enum rprof_mapping_kind */
};

/* The executable mappings of an address space, sorted by start (`spaces`). */
struct rprof_space {
	__u32 count;
	__u32 pad;
	struct rprof_mapping mappings[RPROF_MAX_MAPPINGS];
};

/* One native frame of a record: the pc (leaf) or the return address - 1 (the
 * call), as a vaddr of `file`, or an absolute address when `file` is 0. */
struct rprof_native_frame {
	__u64 addr;
	__u32 file;
	__u32 pad;
};

/* Why a native stack ends where it does (the first is a whole stack). */
enum rprof_native_stop {
	RPROF_NATIVE_DONE = 0,	      /* the outermost frame (or no --native) */
	RPROF_NATIVE_NO_MAPPING = 1,  /* a pc outside every mapping rprof knows of */
	RPROF_NATIVE_NO_CFI = 2,      /* a pc without CFI, in a file without frame pointers */
	RPROF_NATIVE_UNSUPPORTED = 3, /* CFI rprof cannot follow */
	RPROF_NATIVE_READ_FAILED = 4, /* the stack could not be read */
	RPROF_NATIVE_BAD_FRAME = 5,   /* a frame below the one before it, or no return address */
	RPROF_NATIVE_TRUNCATED = 6,   /* deeper than RPROF_MAX_NATIVE: the root end is cut */
	RPROF_NATIVE_NO_SPACE = 7,    /* the process's mappings are not known yet */
	RPROF_NATIVE_JIT = 8,	      /* JIT code, and no frame pointer through it */
	RPROF_NATIVE_NOT_READ = 9,    /* wall: a wait's stack read from userspace, which cannot
				       * unwind natively (a thread blocked before rprof saw it) */
	RPROF_NATIVE_STOP_MAX,
};

enum rprof_sample_flags {
	RPROF_SAMPLE_NO_EC = 1,	       /* thread has no Ruby EC (native/timer thread) */
	RPROF_SAMPLE_TRUNCATED = 2,    /* root-end frames cut at RPROF_MAX_FRAMES */
	RPROF_SAMPLE_FOREIGN_EC = 4,   /* EC belongs to another thread (GVL holder) */
	RPROF_SAMPLE_DIRECT = 8,       /* not aggregated in the kernel: count is 1 */
	RPROF_SAMPLE_READ_FAILED = 16, /* the target's memory could not be read */
	/* taken while a compacting GC may be moving objects: the frames' addresses
	 * may be old or new homes of their objects, so they are not named */
	RPROF_SAMPLE_GC_MOVING = 32,
	/* taken at a GC's edge, inside the GC but in no phase: it has counted
	 * itself and not started marking, or finished and not yet left; the
	 * sample is at gc_time or the time before, and must hold at both */
	RPROF_SAMPLE_GC_EDGE = 64,
	/* wall: time of short waits whose stack no walk sampled (a thread's
	 * last few ms of a kind, when the recording ended) */
	RPROF_SAMPLE_UNSAMPLED = 128,
	/* the record carries a reading of the GC's clock (`clock`), made as
	 * userspace makes its own: the first record of its process at a GC time */
	RPROF_SAMPLE_CLOCK = 256,
	/* wall: time for the stack `hash` names (with RPROF_SAMPLE_DIRECT, in
	 * `weight`), which the counts map had no room for; no frames: the
	 * stack's record came before */
	RPROF_SAMPLE_BY_HASH = 512,
};

/* A reading of a target's GC clock, word by word in the order read:
 * objspace's major count, its count, its flags, its major count again
 * (src/gc_time.rs: what the order makes true). */
struct rprof_gc_reading {
	__u64 majors_before;
	__u64 count;
	__u64 majors_after;
	__u32 flags;
	__u32 pad;
};

/* objspace->flags (Ruby 2.7 to 3.4): mode (enum gc_mode) in bits 0-1,
 * during_gc, and during_compacting, set for the whole of a compacting GC. */
#define RPROF_GC_MODE_MASK	   3
#define RPROF_GC_MODE_NONE	   0
#define RPROF_GC_MODE_MARKING	   1
#define RPROF_GC_DURING_GC	   (1 << 5)
#define RPROF_GC_DURING_COMPACTING (1 << 6)
#define RPROF_GC_MODE_SWEEPING	   2
/* rprof's own bit beside objspace->flags (which use fewer than 16): the
 * collection marks, but has not yet said of which kind. */
#define RPROF_GC_KIND_UNSET (1U << 31)

/* What the collection a sampled thread runs was doing (none if no
 * collection, or another thread runs it). */
enum rprof_gc_state {
	RPROF_GC_NONE = 0,
	RPROF_GC_MARKING_MINOR = 1,
	RPROF_GC_MARKING_MAJOR = 2,
	RPROF_GC_SWEEPING = 3,	 /* lazy sweeping's steps too */
	RPROF_GC_COMPACTING = 4, /* a compacting GC past its marking */
	RPROF_GC_OTHER = 5,	 /* in a GC, in no phase: its start or its end */
	RPROF_GC_MARKING = 6,	 /* marking, its kind not yet set */
};

/* What a ring buffer record is: its first 32 bits. */
enum rprof_record_kind {
	RPROF_RECORD_SAMPLE = 1,  /* struct rprof_sample_header and frames */
	RPROF_RECORD_PROCESS = 2, /* struct rprof_process_event */
};

/* A change in the tree of followed processes (--subprocesses), sent through
 * the ring buffer in the order the kernel made them, before any sample of
 * the process it names. */
enum rprof_process_change {
	RPROF_PROCESS_FORK = 1, /* `parent` forked `pid` (which has its recipe, if it had one) */
	RPROF_PROCESS_EXEC = 2, /* `pid` runs a new program: its recipe is gone */
	RPROF_PROCESS_EXIT = 3, /* the last thread of `pid` ended */
};

struct rprof_process_event {
	__u32 kind;   /* RPROF_RECORD_PROCESS */
	__u32 change; /* enum rprof_process_change */
	__u32 pid;
	__u32 parent; /* FORK: the process that forked */
	__u64 start_ticks;
	__u64 parent_start_ticks;
	/* FORK of a profiled parent: its GC time at the fork (the child starts
	 * with the same heap at the same time), else 0. */
	__u64 gc_time;
	/* FORK: 1 if the child got its parent's recipe (the parent had one). */
	__u32 inherited;
	__u32 pad;
};

/* A process followed with --subprocesses (key: tgid): its forks are followed too. */
struct rprof_followed {
	__u64 start_ticks;
};

/* Header of a ring buffer record; `nframes` struct rprof_frame follow, leaf first,
 * then `nnative` native frames and `nkernel` kernel addresses. */
struct rprof_sample_header {
	__u32 kind; /* RPROF_RECORD_SAMPLE */
	__u32 pid;
	__u64 hash; /* identity of (process, tid, Ruby thread, event, GC time, frames): key of the
		       counts maps */
	/* The target GC's time when the frames were read: 2 * count + (marking ? 0 : 1).
	 * Addresses name the same objects only within one GC time (src/gc_time.rs). */
	__u64 gc_time;
	/* The rb_thread_t of an M:N thread (one sharing native threads), else 0:
	 * it identifies the Ruby thread for as long as the thread lives. */
	__u64 ruby_thread;
	__u64 start_ticks; /* of the process: with pid, its identity */
	__u32 tid;
	__u32 event; /* 0: cpu sample; n: the n-th traced tracepoint */
	__u32 flags; /* enum rprof_sample_flags */
	__u32 nframes;
	char comm[16];
	/* --native: struct rprof_native_frame follow the Ruby frames, leaf first */
	__u32 nnative;
	__u32 native_stop; /* enum rprof_native_stop */
	/* --kernel: kernel addresses (__u64) follow those, leaf first */
	__u32 nkernel;
	__u32 wall_state;   /* wall: enum rprof_wall_state; 0 otherwise */
	__s32 wall_syscall; /* wall, off CPU: the system call it is in, or -1 */
	__u32 wall_object;  /* wall, blocked: what it waits on (enum rprof_wall_object) */
	__u64 weight;	    /* RPROF_SAMPLE_DIRECT: what it counts (1, or ns in wall mode) */
	__u32 gc_state;	    /* enum rprof_gc_state: the collection this thread runs */
	/* wall, blocked on a socket: an IP socket's peer, or for a listening one
	 * (RPROF_WALL_OBJECT_LISTENING) the port it listens on; a Unix socket's
	 * path; family 0: none */
	__u16 peer_family; /* AF_INET, AF_INET6, AF_UNIX */
	/* host order; AF_UNIX: whose path (enum rprof_unix_path) */
	__u16 peer_port;
	/* network order, AF_INET in the first 4; AF_UNIX: the FNV-1a hash (a
	 * __u64) of the path as /proc/net/unix shows it (`@` for a NUL); a file,
	 * device or pipe (family 0): its inode (__u64), its file system's device
	 * (__u32, the kernel's dev_t) and the descriptor (__u32) */
	__u8 peer_addr[16];
	/* alloc: the class of the object allocated (0: a hidden object), and
	 * its type (enum ruby_value_type) */
	__u64 alloc_class;
	__u32 alloc_type;
	/* wall, blocked on a connected TCP socket: the socket's own port (host
	 * order): a port its network namespace listens on marks a connection
	 * accepted there, whose peer is a client's passing port */
	__u16 local_port;
	__u16 pad;
	struct rprof_gc_reading clock; /* RPROF_SAMPLE_CLOCK */
};

/* alloc: what an allocation probe's BPF cookie says about the function it
 * is attached to: which argument (from 0) holds the class, which the
 * object's flags, or RPROF_ALLOC_NO_ARG and the object's type. */
enum rprof_alloc_cookie {
	RPROF_ALLOC_ARG_MASK = 0xf,
	RPROF_ALLOC_NO_ARG = 0xf,
	RPROF_ALLOC_FLAGS_SHIFT = 4,
	RPROF_ALLOC_TYPE_SHIFT = 8,
	RPROF_ALLOC_TYPE_MASK = 0x1f,
};

/* wall: what a thread was doing. Off CPU, the reason is read from the
 * thread's own rb_thread_t at switch-out (the kernel alone cannot tell a
 * GVL wait from a sleep: both wait on the same condition variable). */
enum rprof_wall_state {
	RPROF_WALL_RUNNING = 1,	 /* on CPU */
	RPROF_WALL_RUNNABLE = 2, /* ready to run, but the kernel ran something else */
	RPROF_WALL_GVL = 3,	 /* waiting for the GVL */
	RPROF_WALL_BLOCKED = 4,	 /* in a blocking region (GVL released): a system call */
	RPROF_WALL_SLEEP = 5,	 /* Kernel#sleep */
	RPROF_WALL_MUTEX = 6,	 /* Mutex#lock of a mutex another thread holds */
	RPROF_WALL_WAIT = 7,	 /* stopped until woken: Queue#pop, CV#wait, Thread#join, sleep */
	RPROF_WALL_GVL_HELD = 8, /* blocked while holding the GVL (a C call that keeps it) */
	RPROF_WALL_OFF_CPU = 9,	 /* a thread without Ruby (or a Ruby rprof cannot classify) */
	/* The part of a GVL wait in which the GC's clock ran (GC.stat(:time)):
	 * the GVL's holder was collecting. Counted to the wait's stack's hash
	 * xor RPROF_WALL_GC_SALT; userspace names it from the GVL wait's record. */
	RPROF_WALL_GC = 10,
};

enum rprof_wall_gc { RPROF_WALL_GC_SALT = 0x6c9e3779 };

/* wall: time of one kind (slot key: state and system call) whose stack was
 * not walked. A thread that switches more often than RPROF_WALL_WALKS_PER_S
 * walks a random sample of its waits (each with the same chance, whatever
 * its stack); the waits not walked are added up here, and userspace shares
 * their time among the stacks of the walked waits of the same kind, in
 * proportion to those waits' time (ARCHITECTURE.md section 9). */
struct rprof_wall_slot {
	__u32 key; /* RPROF_WALL_KEY(state, syscall); 0: free */
	__u32 pad;
	__u64 pending; /* ns not counted to a stack yet (the sweep: ns it took) */
	__u64 hash;    /* the last walked stack of this kind, 0 before one */
};

#define RPROF_WALL_SLOTS	       8
#define RPROF_WALL_KEY(state, syscall) (((state) << 16) | (((syscall) + 1) & 0xffff))
/* Walks a second a thread makes at most, about: past it, each switch-out
 * walks with a chance set from its rate in the last window. */
#define RPROF_WALL_WALKS_PER_S 2000
#define RPROF_WALL_WINDOW_NS   100000000
#define RPROF_WALL_ALWAYS      65536 /* a chance of 1, in 1/65536ths */

/* wall: whose path names a Unix socket (header's peer_port) */
enum rprof_unix_path {
	RPROF_UNIX_PATH_NONE = 0,      /* no path: a socketpair, a client of one */
	RPROF_UNIX_PATH_LISTENING = 1, /* its own, a stream socket listening */
	RPROF_UNIX_PATH_OWN = 2,       /* its own: accepted on it, or bound to it */
	RPROF_UNIX_PATH_PEER = 3,      /* its peer's: connected to it */
};

/* wall: what a blocked system call waits on: the kind of file its file
 * descriptor is (the first argument, or poll's single descriptor). Read
 * for the waits whose stack is walked, like the stack: a kind of time is
 * its state and system call, and its split by object is the walked waits'. */
enum rprof_wall_object {
	RPROF_WALL_OBJECT_NONE = 0, /* no descriptor, or several (bar Ruby's eventfd) */
	RPROF_WALL_OBJECT_SOCKET = 1,
	RPROF_WALL_OBJECT_PIPE = 2,
	RPROF_WALL_OBJECT_FILE = 3,
	RPROF_WALL_OBJECT_DEVICE = 4,	 /* a character device: a terminal... */
	RPROF_WALL_OBJECT_LISTENING = 5, /* a listening socket (accept) */
};

/* wall: each followed thread's open interval (key: tid). Written by the
 * thread's own switches and samples, and by the sweep userspace runs once an
 * epoch, which moves `mark` with a compare-and-swap. */
struct rprof_wall_task {
	/* (ns << 1) | on_cpu: when the open interval started, and whether on CPU */
	__u64 mark;
	__u64 hash;    /* off CPU: the stack the wait counts to, 0 until known */
	__u64 exec;    /* off CPU: the task's CPU time (sum_exec_runtime) at the mark */
	__u32 state;   /* off CPU: enum rprof_wall_state, 0 if unknown (a wait the sweep opened) */
	__s32 syscall; /* off CPU: the system call it waits in, or -1 */
	/* off CPU, its stack walked: how long the walk held the CPU as the wait
	 * began, not counted yet (walk_part); the thread switched to then, and
	 * whether that thread woke it */
	__u64 walk_ns;
	__u32 walk_next;
	__u32 walk_by_next;
	/* Its switch-out rate, apart for the waits it blocks in [0] and its
	 * preemptions [1] (which other programs' wakeups can make thousands a
	 * second): when the window began, switch-outs in it so far, and the
	 * chance of each walking, in 1/65536ths (0: always). */
	__u64 window_at[2];
	__u32 window_outs[2];
	__u32 walk_chance[2];
	/* a GVL wait: its process's GC clock (ns) when it opened, plus 1; 0:
	 * none (not a GVL wait, or a Ruby without the clock) */
	__u64 gc_at;
	/* ... and when a thread of its process woke it (on_waking); 0: not seen */
	__u64 gc_woke;
	/* a GVL wait woken from outside its process, split at the thread's next
	 * switch-out (settle_owed): its length, stack, the thread's CPU time
	 * and the time when it ended, its GC clock at its start, and its call */
	__u64 owed_ns;
	__u64 owed_hash;
	__u64 owed_exec;
	__u64 owed_end;
	__u64 owed_gc_at;
	/* ... and its GC clock and the CPU time the thread used since it, read
	 * at the thread's first CPU sample after it (0: none yet) */
	__u64 owed_clock;
	__u64 owed_ran;
	__s32 owed_syscall;
	/* the last GVL wait's part not shown to be GC, held until the next GVL
	 * wait ends (hold_gvl_wait): with its stack, call and end */
	__s32 held_syscall;
	__u64 held_ns;
	__u64 held_hash;
	__u64 held_end;
	struct rprof_wall_slot slots[RPROF_WALL_SLOTS];
};

/* wall: a wait's stack, read by userspace, for the open wait that began at
 * `mark` (key: tid). */
/* wall --kernel: a thread's kernel stack, leaf first, taken as it leaves
 * the CPU or, for a thread blocked when the sweep finds it, by the sweep. */
struct rprof_kernel_stack {
	__u64 n;
	__u64 ips[RPROF_MAX_KERNEL];
};

struct rprof_wall_seed {
	__u64 mark;
	__u64 hash;
};

/* wall: what the sweep (iter/task) says of each followed thread. */
struct rprof_wall_thread {
	__u32 pid;
	__u32 tid;
	__u64 start_ticks;  /* of the process */
	__u64 tp;	    /* thread pointer */
	__u64 hash;	    /* its open wait's stack, if known */
	__s64 syscall;	    /* orig_ax: the system call it is in, or -1 */
	__u64 seed_mark;    /* needs_stack: the mark of the wait whose stack is wanted */
	__u32 seen;	    /* 1: it had an interval before this sweep */
	__u32 needs_stack;  /* 1: blocked in a wait with no stack yet: userspace reads
			     * it (it cannot change until the thread runs) and gives it
			     * in `wall_seeds` */
	__u32 state;	    /* needs_stack: the wait's state, 0 if unknown */
	__s32 wait_syscall; /* needs_stack: the system call it waits in */
	/* stacks of GVL waits that ended but are counted later (held_hash of
	 * hold_gvl_wait, owed_hash of settle_owed), or 0: kept named */
	__u64 held_hash;
	__u64 owed_hash;
	/* each slot's key and stack, and the pending time the sweep took:
	 * counted to that stack, or by userspace with no stack if it has none */
	struct rprof_wall_slot slots[RPROF_WALL_SLOTS];
};

/*
 * Value of the in-kernel counts maps (key: the stack's hash). There are two:
 * BPF counts into counts[epoch & 1] while userspace drains the other, then
 * userspace bumps `epoch`. The first event of a stack in each epoch sends the
 * stack itself through the ring buffer.
 */
struct rprof_stack_count {
	__u64 count;
	__u64 emitted; /* the stack reached the ring buffer this epoch */
};

/* Indexes of the per-CPU `stats` array. */
enum rprof_stat {
	RPROF_STAT_EVENTS = 0,	   /* events of target threads (cpu: what their samples count) */
	RPROF_STAT_LOST,	   /* events whose stack the full ring buffer refused */
	RPROF_STAT_READ_FAILED,	   /* events whose EC or frames could not be read */
	RPROF_STAT_TRUNCATED,	   /* events with more than RPROF_MAX_FRAMES frames */
	RPROF_STAT_NO_EC,	   /* events of threads without a Ruby EC */
	RPROF_STAT_FOREIGN_EC,	   /* events whose EC belonged to another thread */
	RPROF_STAT_AGG_FULL,	   /* events sent directly because a counts map was full */
	RPROF_STAT_VERIFIED,	   /* events whose EC was checked to be this thread's */
	RPROF_STAT_OTHER_PROCESS,  /* events of a process that reused a target's PID */
	RPROF_STAT_PROCESS_LOST,   /* process events the full ring buffer refused */
	RPROF_STAT_NOT_PROFILED,   /* events of followed processes without a recipe (yet) */
	RPROF_STAT_WALL_UNSEEN,	   /* wall: ns of threads off CPU since before rprof saw them */
	RPROF_STAT_WALL_LOST,	   /* wall: ns the full counts map and ring buffer refused */
	RPROF_STAT_WALL_MISSED_IN, /* wall: threads found running that no switch-in showed */
	RPROF_STAT_CPU_SKIPPED,	   /* cpu: ticks not counted, the thread's samples ahead of its CPU
				      time */
	RPROF_STAT_CPU_ADDED,	   /* cpu: counted beyond 1 by samples of threads behind it */
	/* --native: events whose native stack ended for each enum rprof_native_stop */
	RPROF_STAT_NATIVE_STOP,
	RPROF_STAT_MAX = RPROF_STAT_NATIVE_STOP + RPROF_NATIVE_STOP_MAX,
};

#endif /* RPROF_H */
