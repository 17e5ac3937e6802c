from typing_extensions import Buffer

def longest_prefix(segment: Buffer, keys: Buffer, slots_offset: int, num_groups: int,
                   divisor: int, /) -> int: ...
