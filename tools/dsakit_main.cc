#include <cstdio>
int main() { std::puts("dsakit: under construction"); return 0; }
