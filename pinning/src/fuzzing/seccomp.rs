//! A seccomp filter that refuses `io_uring_setup`, for tests of kernel mode where io_uring
//! is refused (as a container runtime's default profile refuses it) without the system-wide
//! `kernel.io_uring_disabled`, which tests running side by side must not set.

/// Makes `io_uring_setup` fail with `errno` in the calling thread and every thread and
/// program it starts from now on (x86-64 system call numbers, this target's). Allocates
/// nothing and makes only prctl(2) and seccomp(2) calls, so a `pre_exec` closure may call it
/// between fork and exec (exec keeps the filter).
pub fn deny_io_uring_setup(errno: i32) -> std::io::Result<()> {
    const BPF_LD_W_ABS: u16 = 0x20;
    const BPF_JMP_JEQ_K: u16 = 0x15;
    const BPF_RET_K: u16 = 0x06;
    const SECCOMP_RET_ERRNO: u32 = 0x0005_0000;
    const SECCOMP_RET_ALLOW: u32 = 0x7fff_0000;
    const SECCOMP_SET_MODE_FILTER: libc::c_ulong = 1;
    // Offset 0 of seccomp_data: the system call's number.
    let filter = [
        libc::sock_filter { code: BPF_LD_W_ABS, jt: 0, jf: 0, k: 0 },
        libc::sock_filter { code: BPF_JMP_JEQ_K, jt: 0, jf: 1, k: libc::SYS_io_uring_setup as u32 },
        libc::sock_filter { code: BPF_RET_K, jt: 0, jf: 0, k: SECCOMP_RET_ERRNO | (errno as u32 & 0xffff) },
        libc::sock_filter { code: BPF_RET_K, jt: 0, jf: 0, k: SECCOMP_RET_ALLOW },
    ];
    let program =
        libc::sock_fprog { len: filter.len() as u16, filter: filter.as_ptr() as *mut libc::sock_filter };
    // SAFETY: prctl takes no pointer; seccomp reads the program, which with its filter lives
    // on this stack across the call.
    let done = unsafe {
        libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
            && libc::syscall(
                libc::SYS_seccomp,
                SECCOMP_SET_MODE_FILTER,
                0,
                &program as *const libc::sock_fprog,
            ) == 0
    };
    if done {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}
