// Raises small thread stack requests process-wide.
//
// Debian's civetweb (the HTTP server inside prometheus-cpp's Exposer) starts
// its threads with a fixed 100 KiB stack. With LibTorch, OpenBLAS and glog
// loaded, the process's static TLS alone exceeds that, so pthread_create fails
// with EINVAL and the metrics endpoint cannot start ("null context when
// constructing CivetServer"). Defining the function in the executable
// interposes it for every library; requests below 1 MiB get 1 MiB.
#include <dlfcn.h>
#include <pthread.h>

#include <algorithm>
#include <cstddef>

extern "C" int pthread_attr_setstacksize(pthread_attr_t* attr,
                                         size_t stack_size) {
  using SetStackSize = int (*)(pthread_attr_t*, size_t);
  static const SetStackSize real = reinterpret_cast<SetStackSize>(
      dlsym(RTLD_NEXT, "pthread_attr_setstacksize"));
  constexpr size_t kMinStack = size_t{1} << 20;
  return real(attr, std::max(stack_size, kMinStack));
}
