/*
 * A C extension for rprof's --native tests, built by the tests with mkmf at
 * -O2 -fomit-frame-pointer: RprofNative.burn(n) calls a -> b -> c, and c
 * burns CPU; RprofNative.yield_each(n) { } calls a native helper that
 * yields to the block n times; RprofNative.signal_burn(n) burns in a signal
 * handler (a signal frame on the stack); RprofNative.no_cfi_burn(n) burns in
 * a function without CFI; RprofNative.deep(depth, n) recurses `depth` native
 * frames deep, then burns. Each function does work after its call, so none
 * becomes a tail call and every one keeps a frame of its own.
 */
#include <ruby.h>
#include <pthread.h>
#include <signal.h>

static volatile unsigned long sink;

__attribute__((noinline)) static unsigned long rprof_c(unsigned long n)
{
    unsigned long x = n;

    for (unsigned long i = 0; i < n; i++)
        x = x * 6364136223846793005UL + i;
    sink = x;
    return x;
}

__attribute__((noinline)) static unsigned long rprof_b(unsigned long n)
{
    return rprof_c(n) ^ sink;
}

__attribute__((noinline)) static unsigned long rprof_a(unsigned long n)
{
    return rprof_b(n) ^ sink;
}

static VALUE burn(VALUE self, VALUE n)
{
    return ULONG2NUM(rprof_a(NUM2ULONG(n)) & 0xffff);
}

__attribute__((noinline)) static VALUE rprof_yielder(long n)
{
    VALUE last = Qnil;

    for (long i = 0; i < n; i++)
        last = rb_yield(LONG2NUM(i));
    sink++;
    return last;
}

static VALUE yield_each(VALUE self, VALUE n)
{
    VALUE last = rprof_yielder(NUM2LONG(n));

    sink++;
    return last;
}

/* The signal handler burns; its caller is the kernel's signal frame. */
static unsigned long handler_n;

__attribute__((noinline)) static void rprof_in_handler(void)
{
    sink = rprof_c(handler_n) ^ sink;
}

static void rprof_handler(int sig)
{
    rprof_in_handler();
    sink += sig;
}

__attribute__((noinline)) static void rprof_signaler(long times)
{
    for (long i = 0; i < times; i++)
        pthread_kill(pthread_self(), SIGUSR2);
    sink++;
}

static VALUE signal_burn(VALUE self, VALUE n)
{
    struct sigaction sa, old;

    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = rprof_handler;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGUSR2, &sa, &old);
    handler_n = NUM2ULONG(n);
    rprof_signaler(10);
    sigaction(SIGUSR2, &old, NULL);
    return Qnil;
}

/* A function with no CFI at all, as hand-written assembly may be. */
unsigned long rprof_no_cfi(unsigned long n);
__asm__(".text\n"
        ".type rprof_no_cfi, @function\n"
        "rprof_no_cfi:\n"
        "  mov %rdi, %rax\n"
        "1: sub $1, %rax\n"
        "  jnz 1b\n"
        "  ret\n"
        ".size rprof_no_cfi, .-rprof_no_cfi\n");

static VALUE no_cfi_burn(VALUE self, VALUE n)
{
    sink = rprof_no_cfi(NUM2ULONG(n)) ^ sink;
    return Qnil;
}

__attribute__((noinline)) static unsigned long rprof_deep(long depth, unsigned long n)
{
    unsigned long r = depth > 0 ? rprof_deep(depth - 1, n) : rprof_c(n);

    sink = r;
    return r + (unsigned long)depth;
}

static VALUE deep(VALUE self, VALUE depth, VALUE n)
{
    return ULONG2NUM(rprof_deep(NUM2LONG(depth), NUM2ULONG(n)) & 0xffff);
}

void Init_rprof_native(void)
{
    VALUE m = rb_define_module("RprofNative");

    rb_define_module_function(m, "signal_burn", signal_burn, 1);
    rb_define_module_function(m, "no_cfi_burn", no_cfi_burn, 1);
    rb_define_module_function(m, "deep", deep, 2);
    rb_define_module_function(m, "burn", burn, 1);
    rb_define_module_function(m, "yield_each", yield_each, 1);
}
