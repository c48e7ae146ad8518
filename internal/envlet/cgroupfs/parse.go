package cgroupfs

// Allocation-free parsers for the flat-keyed and single-value cgroup files.
// They scan the bytes read by pread; comparing a byte slice converted to a
// string in an equality does not allocate.

// field returns the unsigned value of "key value" in a flat-keyed file
// (cpu.stat, memory.stat, memory.events, memory.oom_control).
func field(b []byte, key string) (uint64, bool) {
	for i := 0; i < len(b); {
		end := i
		for end < len(b) && b[end] != '\n' {
			end++
		}
		line := b[i:end]
		if len(line) > len(key) && line[len(key)] == ' ' && string(line[:len(key)]) == key {
			v, ok := parseUint(line[len(key)+1:])
			return v, ok
		}
		i = end + 1
	}
	return 0, false
}

// parseUint parses leading decimal digits, ignoring surrounding blanks.
func parseUint(b []byte) (uint64, bool) {
	i := 0
	for i < len(b) && (b[i] == ' ' || b[i] == '\t') {
		i++
	}
	start := i
	var v uint64
	for i < len(b) && b[i] >= '0' && b[i] <= '9' {
		v = v*10 + uint64(b[i]-'0')
		i++
	}
	return v, i > start
}

// parseLimit parses a limit file: a number, or "max" / "-1" for unlimited
// (returned as -1).
func parseLimit(b []byte) (int64, bool) {
	i := 0
	for i < len(b) && (b[i] == ' ' || b[i] == '\t') {
		i++
	}
	if len(b)-i >= 3 && string(b[i:i+3]) == "max" {
		return -1, true
	}
	if i < len(b) && b[i] == '-' {
		return -1, true
	}
	v, ok := parseUint(b[i:])
	return int64(v), ok
}

// appendInt formats v into dst without fmt (used on every actuation).
func appendInt(dst []byte, v int64) []byte {
	if v < 0 {
		dst = append(dst, '-')
		v = -v
	}
	var tmp [20]byte
	i := len(tmp)
	for {
		i--
		tmp[i] = byte('0' + v%10)
		v /= 10
		if v == 0 {
			break
		}
	}
	return append(dst, tmp[i:]...)
}
